"""The inputs of the policy losses: one micro-batch's tensors, the loss hyper-parameters, and the
optimizer-step totals the losses divide by (:mod:`grpo_ascend.algorithms.losses` uses them).

Normaliser fields (per rank; under data parallelism the gradients are then *averaged* over the
W ranks, which is why the global fields divide by W). With these, W ranks compute exactly the
gradient one process would over the same global batch, for every loss type (every rank holds the
same number of sequences per step, so grpo and dr_grpo need no global count):

* ``num_sequences``: sequences this rank processes in this optimizer step (all micro-batches).
* ``num_tokens``: valid (mask = 1) completion tokens of this optimizer step summed over all ranks,
  divided by W (one rank: this rank's tokens). After the gradient average over ranks, bnpo is the
  token mean of the whole step, whichever rank holds the long completions.
* ``num_tokens_per_step_global``: valid completion tokens of the whole generation batch summed
  over all ranks, divided by (optimizer steps that generation batch feeds × W). After the
  gradient average over ranks, each optimizer step's gradient is
  Σ_{all tokens of the step, all ranks} ∇L / (mean global tokens per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from grpo_ascend.algorithms.kl import KL_ESTIMATORS
from grpo_ascend.errors import ConfigError, closest

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
Number = Tensor | float | int


@dataclass
class PolicyLossBatch:
    """Tensors of one micro-batch. ``[B, T]`` unless noted; all on the same device.

    logps: log-probs of the sampled tokens under the current policy (with grad).
    advantages: ``[B]`` (one per sequence, GRPO) or ``[B, T]`` (per token, PPO/GAE).
    mask: 0/1 (or bool) validity of completion tokens.
    old_logps: log-probs under the policy that sampled; None → ``logps.detach()`` (ratio 1).
    ref_logps: log-probs under the reference model; needed when beta > 0.
    entropies: per-token entropies (with grad); needed when entropy_coef != 0.
    weights: optional ``[B]`` or ``[B, T]`` importance-sampling correction weights (no grad) for the
        sampler/trainer mismatch (see ``importance_sampling.py``); they multiply the policy-gradient
        term of each token, not the KL penalty or the entropy bonus (as TRL). None = all 1.
    sampling_logps: the sampler's log-probs, for ``off_policy_mask_threshold`` (None: ``old_logps``).
    selection: optional ``[B, T]`` 0/1 tokens whose policy term and entropy bonus count (the high-entropy
        tokens of ``top_entropy_quantile``); the others still count in the normalisers. None = all.
    """

    logps: Tensor
    advantages: Tensor
    mask: Tensor
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    entropies: Tensor | None = None
    weights: Tensor | None = None
    sampling_logps: Tensor | None = None
    selection: Tensor | None = None


@dataclass
class PolicyLossSettings:
    """Hyper-parameters, TRL names and meanings. ``epsilon_high=None`` means ``epsilon``.

    ``kl_estimator``: k1 | k2 | k3 (see ``kl.py``). ``use_bias_correction_kl``: multiply the KL term
    by the importance ratio π_θ/π_old (with its gradient; per sequence under GSPO), as TRL 1.16.
    ``sapo_temperature_pos/neg``: SAPO's gate temperatures for A > 0 and A <= 0. For ``cispo``,
    ``epsilon_high`` is the absolute cap ε_max on the importance weight (TRL's meaning; unset: ``epsilon``,
    as TRL). ``vespo_k_pos/neg``, ``vespo_lambda_pos/neg``: VESPO's gamma-weight shape per advantage sign.
    ``off_policy_mask_threshold``: δ of the off-policy sequence mask (None = off).
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    entropy_coef: float = 0.0
    importance_sampling_level: str = "token"
    max_completion_length: int | None = None
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None

    def __post_init__(self) -> None:
        if not self.epsilon >= 0:
            raise ConfigError(f"epsilon must be >= 0, got {self.epsilon!r}")
        if self.epsilon_high is not None and not self.epsilon_high >= 0:
            raise ConfigError(f"epsilon_high must be >= 0, got {self.epsilon_high!r}")
        if self.delta is not None and not self.delta > 1 + self.eps_high:
            raise ConfigError(
                f"delta={self.delta!r} must be > 1 + epsilon_high = {1 + self.eps_high!r} "
                "(it caps the unclipped ratio above the clipping range)"
            )
        if not self.beta >= 0:
            raise ConfigError(f"beta must be >= 0, got {self.beta!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            hint = closest(str(self.importance_sampling_level), IMPORTANCE_SAMPLING_LEVELS)
            raise ConfigError(
                f"importance_sampling_level={self.importance_sampling_level!r} is not valid{hint}; "
                f"use one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
            )
        if self.max_completion_length is not None and not self.max_completion_length >= 1:
            raise ConfigError(f"max_completion_length must be >= 1, got {self.max_completion_length!r}")
        KL_ESTIMATORS.get(self.kl_estimator)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        threshold = self.off_policy_mask_threshold
        if threshold is not None and not math.isfinite(threshold):
            raise ConfigError(f"off_policy_mask_threshold must be a finite number or None, got {threshold!r}")

    @property
    def eps_high(self) -> float:
        """Upper clipping width: ``epsilon_high`` or, when unset, ``epsilon``."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class LossNormaliser:
    """Optimizer-step totals the losses divide by (the module docstring defines each field)."""

    num_sequences: Number
    num_tokens: Number
    num_tokens_per_step_global: Number

    @classmethod
    def for_step(
        cls,
        step_mask: Tensor,
        generation_tokens_global: Number | None = None,
        steps_per_generation: int = 1,
        world_size: int = 1,
        step_tokens_global: Number | None = None,
    ) -> LossNormaliser:
        """Build the normaliser from the completion mask [S, T] of ALL sequences of this optimizer
        step on this rank, and the valid-token count of the whole generation batch over all ranks
        (None: use this rank's step count, i.e. the step is the whole generation batch, one rank).
        ``step_tokens_global``: this step's valid tokens summed over all ranks (None: this rank's,
        right for one rank)."""
        if steps_per_generation < 1 or world_size < 1:
            raise ConfigError(
                f"steps_per_generation ({steps_per_generation}) and world_size ({world_size}) must be >= 1"
            )
        num_tokens = step_mask.sum()
        if step_tokens_global is not None:
            num_tokens = step_tokens_global / world_size
        if generation_tokens_global is None:
            per_step_global = num_tokens
        else:
            per_step_global = generation_tokens_global / (steps_per_generation * world_size)
        return cls(
            num_sequences=step_mask.shape[0],
            num_tokens=num_tokens,
            num_tokens_per_step_global=per_step_global,
        )
