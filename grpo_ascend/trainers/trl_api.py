"""TRL 1.16 ``GRPOTrainer``'s methods and attributes that users' subclasses, callbacks and tests call, on our
GRPO trainer: ``get_high_entropy_mask``, ``get_off_policy_mask``, ``aux_loss_enabled``,
``reward_processing_classes``, ``reward_funcs`` / ``reward_func_names`` / ``reward_weights``, ``tools``, ``ref_model``, ``entropy_coef`` and a settable ``model``; ``training_step``'s
inputs (:class:`MicroBatchInputs`). The maths is grpo_ascend/algorithms/token_selection.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend.algorithms.token_selection import entropy_quantile_mask, off_policy_sequence_mask
from grpo_ascend.errors import ConfigError
from grpo_ascend.experience import Experience
from reward_models.reward_model import RewardModelScorer

#: Pads each rank's valid entropies to one length before the gather; dropped again (entropies are >= 0).
_SENTINEL = -1e9


@dataclass
class MicroBatchInputs:
    """What :meth:`GRPOTrainer.training_step` trains on: rows ``rows`` of the generation batch ``experience``
    (prompts, completions, advantages, old / reference / sampling log-probs). ``sync_gradients``: the step's
    last micro-batch, where gradients are reduced over ranks; ``stats``: the optimizer step's running sums of
    the loss statistics, which each call adds to (the step's metrics are made from them); ``importance_stats``:
    the importance-sampling statistics of weights computed from the training forward (see
    ``ExperienceMaker.importance_weights_deferred``), folded in per micro-batch."""

    experience: Experience
    rows: Tensor
    sync_gradients: bool = True
    stats: dict[str, Tensor] = field(default_factory=dict)
    importance_stats: dict[str, Tensor] = field(default_factory=dict)

    @property
    def prompts(self) -> list[Any]:
        """The micro-batch's prompts, one per completion (a group's prompt repeated, as TRL's inputs)."""
        return [self.experience.prompts[i] for i in self.rows.tolist()]


class TRLTrainerAPI:
    """TRL's trainer methods and attributes, mixed into :class:`~grpo_ascend.trainers.grpo.GRPOTrainer`."""

    @staticmethod
    def get_off_policy_mask(advantages: Tensor, per_token_logps: Tensor, sampling_per_token_logps: Tensor,
                            mask: Tensor, off_policy_threshold: float) -> Tensor:
        """DeepSeek-V3.2's off-policy sequence mask, TRL's signature: [B, 1] in ``mask``'s dtype, 1 = keep (a
        non-negative advantage, or a mean per-token log π_sampler − log π over ``mask`` of at most the threshold)."""
        kept = off_policy_sequence_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                        off_policy_threshold)
        return kept.to(mask.dtype)

    def get_high_entropy_mask(self, entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
        """Bool [B, T]: valid tokens (``mask`` 1) whose entropy is >= the ``threshold`` quantile of every rank's
        valid entropies (TRL's meaning: ``threshold`` = 1 − ``top_entropy_quantile``); every rank must call."""
        accelerator = self.accelerator  # type: ignore[attr-defined]

        def gather(local: Tensor) -> Tensor:
            if accelerator.num_processes == 1:
                return local
            padded = accelerator.pad_across_processes(local, dim=0, pad_index=_SENTINEL)
            return accelerator.gather(padded)

        return entropy_quantile_mask(entropies, mask, threshold, gather)

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether a Mixture-of-Experts policy's load-balancing loss is added to the loss (TRL's rule,
        models/router_aux.py)."""
        return self.router_aux is not None  # type: ignore[attr-defined]

    @property
    def reward_processing_classes(self) -> list[Any]:
        """One entry per reward function, as TRL: a reward model's tokenizer (the one given, else its own),
        None for other functions (environments' rewards included)."""
        return [f.tokenizer if isinstance(f, RewardModelScorer) else None
                for f in self.rewards.funcs]  # type: ignore[attr-defined]

    @property
    def reward_funcs(self) -> list[Any]:
        """The reward functions in scoring order (a reward model given by name: its loaded scorer), environments'
        ``get_reward`` sources last, as TRL appends them."""
        return list(self.rewards.funcs)  # type: ignore[attr-defined]

    @property
    def reward_func_names(self) -> list[str]:
        """The reward functions' names, as their metrics name them (an environment's reward: its class name)."""
        return list(self.rewards.names)  # type: ignore[attr-defined]

    @property
    def reward_weights(self) -> Tensor:
        """float32 [number of reward functions]: ``args.reward_weights`` (1 each when unset), 1 for each
        environment's reward."""
        return torch.tensor(self.rewards.weights, dtype=torch.float32)  # type: ignore[attr-defined]

    @property
    def tools(self) -> list[Any]:
        """The functions offered as tools: the ``tools`` given, then every environment's methods (empty without
        tools)."""
        return list(self._offered_tools)  # type: ignore[attr-defined]

    @property
    def ref_model(self) -> nn.Module | None:
        """The reference model (its weights move with ``sync_ref_model``); None when ``beta`` is 0 or under LoRA,
        where the reference is the policy with its adapters disabled (TRL: None for PEFT too)."""
        reference = self.ref_logprob_model  # type: ignore[attr-defined]
        return None if reference is None else reference.model

    @property
    def entropy_coef(self) -> float:
        """The entropy-bonus coefficient: ``args.entropy_coef``, moved after each step by ``use_adaptive_entropy``."""
        return self.entropy_control.coef  # type: ignore[attr-defined]

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self.entropy_control.coef = float(value)  # type: ignore[attr-defined]

    @property
    def model(self) -> Any:
        """The model being trained: the PEFT-wrapped policy with LoRA, else the policy itself."""
        return self.policy  # type: ignore[attr-defined]

    @model.setter
    def model(self, value: Any) -> None:
        """Before the trainer is built (``object.__new__`` in tests) the value is stored as is; on a built trainer
        the same model is a no-op and another module with the same parameter names and shapes has its weights
        copied into the policy in place, so the optimizer, its state, the prepared engines and the rollout keep
        training the one policy. Anything else is refused."""
        if "policy" not in self.__dict__ or "optimizer" not in self.__dict__:
            self.policy = value
            return
        policy: nn.Module = self.policy  # type: ignore[has-type]
        if value is policy:
            return
        if not isinstance(value, nn.Module):
            raise ConfigError(f"trainer.model = {type(value).__name__}: expected a torch nn.Module with the policy's "
                              f"parameters ({type(policy).__name__}); its weights are copied into the trained policy")
        ours, theirs = policy.state_dict(), value.state_dict()
        wrong = sorted(set(ours) ^ set(theirs)) or sorted(k for k in ours if ours[k].shape != theirs[k].shape)
        if wrong:
            raise ConfigError(f"trainer.model = {type(value).__name__}: its parameters differ from the policy's "
                              f"({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}); give a model of the same "
                              "architecture (and the same LoRA adapters), whose weights are then copied in")
        with torch.no_grad():
            for name, tensor in ours.items():
                tensor.copy_(theirs[name].to(tensor.device, tensor.dtype))
