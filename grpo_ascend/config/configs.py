"""Trainer configuration: ``GRPOConfig`` / ``PPOConfig`` (TRL's field names and meanings) and the batch plan.

Every field carries its help text in ``metadata["help"]`` so the README's config reference is
generated from these dataclasses and cannot drift. Values come from Python, a YAML recipe, or
``--key value`` overrides on the command line (:mod:`grpo_ascend.config.recipe`); bad values raise
:class:`ConfigError` with one clear line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

from grpo_ascend.algorithms.reward_aggregation import REWARD_AGGREGATIONS
from grpo_ascend.algorithms.token_selection import check_quantile
from grpo_ascend.config.base_config import BaseRLConfig
from grpo_ascend.config.batch_plan import BatchPlan  # noqa: F401  (re-exported)
from grpo_ascend.config.fields import _check_choice, _f, _positive
from grpo_ascend.config.trl_keywords import own_keywords
from grpo_ascend.errors import ConfigError, closest
from grpo_ascend.tools.parsing import TOOL_CALL_PARSERS

KLEstimatorName = Literal["k1", "k2", "k3"]
ImportanceSamplingMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _accepts_trl_keywords(cls: type) -> type:
    """Let ``cls(...)`` also take every TRL 1.16 ``GRPOConfig`` field as a keyword, classified as for a
    ``trl.GRPOConfig`` object (:func:`grpo_ascend.config.trl_keywords.own_keywords`); its own fields are untouched."""
    init = cls.__init__
    own = {f.name for f in dataclasses.fields(cls) if f.init}

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.keys() - own:  # imported here: trl_keywords' table imports grpo_ascend.distributed, which imports us

            kwargs = own_keywords(type(self), kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@_accepts_trl_keywords
@dataclass
class GRPOConfig(BaseRLConfig):
    """GRPO settings. Field names and meanings follow TRL's GRPOConfig where TRL has the concept; TRL's other
    fields are accepted as keywords too (docs/trl_compatibility.md)."""

    learning_rate: float = _f(1e-6, "AdamW peak learning rate.")
    beta: float = _f(0.0, "KL coefficient to the reference policy (k3 estimator); 0 = no reference model.")
    epsilon: float = _f(0.2, "Lower clipping range: ratio clipped at 1 - epsilon.")
    epsilon_high: float | None = _f(
        None, "Upper clipping range (DAPO clip-higher); null = epsilon. For loss_type='cispo': the cap ε_max on the "
        "importance weight itself (e.g. 5.0)."
    )
    delta: float | None = _f(None, "Cap on the unclipped ratio (two-sided clipping); must exceed 1 + epsilon_high.")
    loss_type: str = _f(
        "dapo", "Policy loss: grpo | bnpo | dr_grpo | dapo | luspo (aggregations of the clipped objective; luspo = "
        "mean over sequences of each sequence's token sum), cispo (MiniMax-M1: clipped, detached IS weight × A × "
        "log π, aggregated like dapo; the cap is epsilon_high, else epsilon), sapo (soft gate σ(τ(r−1))·4/τ instead "
        "of clipping, aggregated like grpo), vespo (gamma-weighted sequence ratio × A × log π, aggregated like dapo); "
        "gspo = grpo with importance_sampling_level sequence (TRL's spelling of GSPO)."
    )
    scale_rewards: str | bool = _f("group", "Advantage scaling: group | batch | none (Dr. GRPO); true = group, false = none.")
    importance_sampling_level: Literal["token", "sequence"] = _f("token", "Importance ratio per token, or per sequence (GSPO).")
    num_iterations: int = _f(1, "μ: optimisation passes over each generation batch.")
    mask_truncated_completions: bool = _f(False, "Exclude completions that hit max_completion_length from the loss.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient (subtracted from the loss).")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop zero-variance groups and refill from more prompts.")
    max_dynamic_sampling_rounds: int = _f(3, "Extra generation rounds allowed to refill dropped groups.")
    advantage_estimator: str = _f("grpo", "Advantage estimator registry name.")
    # --- KL, CISPO / SAPO ---
    kl_estimator: KLEstimatorName = _f(
        "k3", "Per-token KL(π ‖ π_ref) estimator when beta > 0: k1 = log π/π_ref, k2 = ½(log π/π_ref)², "
        "k3 = π_ref/π − log(π_ref/π) − 1 (unbiased and >= 0; TRL's only one)."
    )
    use_bias_correction_kl: bool = _f(
        True, "Multiply the KL term by the importance ratio π/π_old, with its gradient, so the KL gradient is the "
        "unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default). Changes the gradient whenever beta > 0."
    )
    sapo_temperature_pos: float = _f(1.0, "loss_type='sapo': gate temperature τ for tokens with positive advantage.")
    sapo_temperature_neg: float = _f(1.05, "loss_type='sapo': gate temperature τ for tokens with advantage <= 0.")
    # --- TRL 1.16's further algorithm options (their meanings; docs/trainer.md) ---
    vespo_k_pos: float = _f(2.0, "loss_type='vespo': shape k of the gamma weight φ(w) = e^λ·w^k·e^(−λw) where A >= 0.")
    vespo_lambda_pos: float = _f(3.0, "loss_type='vespo': rate λ of the gamma weight where A >= 0.")
    vespo_k_neg: float = _f(3.0, "loss_type='vespo': shape k of the gamma weight where A < 0.")
    vespo_lambda_neg: float = _f(2.0, "loss_type='vespo': rate λ of the gamma weight where A < 0.")
    multi_objective_aggregation: str = _f(
        "sum_then_normalize", "Several reward functions: sum_then_normalize (weighted sum, then the advantage "
        "estimator with scale_rewards) | normalize_then_sum (GDPO: each function normalised within its group, "
        "weighted sum, then normalised over the batch; scale_rewards has no effect, advantage_estimator must be grpo)."
    )
    off_policy_mask_threshold: float | None = _f(
        None, "DeepSeek-V3.2 off-policy sequence masking: a completion with negative advantage whose mean per-token "
        "log π_sampler − log π is above this is left out of the policy term (e.g. 0.5); null = off."
    )
    top_entropy_quantile: float = _f(
        1.0, "Train the policy term (and the entropy bonus) only on the tokens whose entropy is in this top fraction "
        "of each micro-batch's completion tokens over all processes (0.2 as in 'Beyond the 80/20 rule'); 1 = all."
    )
    use_adaptive_entropy: bool = _f(
        False, "Skywork-OR1 adaptive entropy: after each optimizer step entropy_coef moves by entropy_coef_delta "
        "(up when the step's mean entropy is at or below entropy_target, down otherwise, within entropy_coef_min/max); "
        "the bonus applies only while the last step's entropy is at or below the target."
    )
    entropy_coef_min: float = _f(0.0, "use_adaptive_entropy: lower bound of entropy_coef.")
    entropy_coef_max: float = _f(1.0, "use_adaptive_entropy: upper bound of entropy_coef.")
    entropy_coef_delta: float = _f(0.005, "use_adaptive_entropy: change of entropy_coef per optimizer step.")
    entropy_target: float = _f(0.2, "use_adaptive_entropy: target mean per-token entropy (nats).")
    router_aux_loss_coef: float | None = _f(
        None, "TRL's weight of a Mixture-of-Experts model's load-balancing loss; null = the model config's. "
        "As TRL, the model's own loss is added (coef · loss / gradient_accumulation_steps per micro-batch, logged "
        "as aux_loss) when the model config declares output_router_logits and the weight is not 0; 0.0 trains "
        "without it; a non-MoE model needs null or 0."
    )
    cast_lm_head_to_fp32: bool = _f(
        False, "Compute the output head (logits) in float32 in training, the reference and the rollout, whatever the "
        "model's dtype or autocast (ScaleRL); a head tied to the input embeddings keeps them in its float32 weight."
    )
    sync_ref_model: bool = _f(
        False, "TR-DPO reference updates: every ref_model_sync_steps optimizer steps the reference becomes "
        "ref_model_mixup_alpha × policy + (1 − alpha) × reference. Needs beta > 0 and full fine-tuning (under LoRA "
        "the reference is the base with adapters off, see docs/trainer.md)."
    )
    ref_model_mixup_alpha: float = _f(0.6, "sync_ref_model: weight α of the policy in the reference update.")
    ref_model_sync_steps: int = _f(512, "sync_ref_model: optimizer steps between reference updates.")
    # --- tool calling (GRPOTrainer(tools=..., environment_factory=...)) ---
    max_tool_calling_iterations: int | None = _f(
        None, "Tool steps per completion; a turn with calls past it ends the completion; null = only "
        "max_completion_length (generated + tool tokens) limits it (TRL's meaning)."
    )
    tool_call_parser: str = _f("qwen", "How tool calls are read from a turn: qwen (Qwen2.5/Qwen3 <tool_call> JSON) | hermes.")
    tool_timeout: float = _f(30.0, "Seconds allowed per tool call; a call past it returns an error message to the model.")
    tool_max_output_chars: int | None = _f(4096, "Tool output longer than this is cut (with a note); null = no limit.")
    # --- off-policy correction of the sampler/trainer mismatch (TRL: vllm_importance_sampling_*) ---
    importance_sampling_correction: bool = _f(
        False, "Re-weight each token's policy-gradient term by π_trainer/π_sampler (from the trainer's old "
        "log-probs and the sampler's), truncated or masked, to correct sampling in another precision or engine."
    )
    importance_sampling_mode: ImportanceSamplingMode | None = _f(
        None, "token_truncate (ratio per token clipped to [clip_min, clip_max]) | token_mask (ratio "
        "set to 0 outside) | sequence_truncate | sequence_mask (one ratio per sequence: product over its tokens); "
        "null = sequence_mask (TRL's) with rollout_mode sync, token_mask with rollouts ahead of training "
        "(one_step_off / async: learns as sync does at max_staleness 4, docs/async.md)."
    )
    importance_sampling_clip_max: float | None = _f(3.0, "Upper bound C_max of the importance ratio; null = none.")
    importance_sampling_clip_min: float | None = _f(None, "Lower bound C_min of the importance ratio; null = none.")
    # TRL 1.16's names for the four settings above; each is moved onto its neutral name (and reset to null).
    vllm_importance_sampling_correction: bool | None = _f(
        None, "TRL alias of importance_sampling_correction.", alias_of="importance_sampling_correction"
    )
    vllm_importance_sampling_mode: str | None = _f(
        None, "TRL alias of importance_sampling_mode.", alias_of="importance_sampling_mode"
    )
    vllm_importance_sampling_clip_max: float | None = _f(
        None, "TRL alias of importance_sampling_clip_max.", alias_of="importance_sampling_clip_max"
    )
    vllm_importance_sampling_clip_min: float | None = _f(
        None, "TRL alias of importance_sampling_clip_min.", alias_of="importance_sampling_clip_min"
    )
    vllm_importance_sampling_cap: float | None = _f(
        None, "TRL's deprecated alias of importance_sampling_clip_max.", alias_of="importance_sampling_clip_max"
    )

    @property
    def needs_reference_model(self) -> bool:
        """The KL term to the reference policy is on (``beta > 0``)."""
        return self.beta > 0

    def __post_init__(self) -> None:
        off_policy = self.use_vllm or self.rollout_backend == "vllm" or self.rollout_mode != "sync"
        if off_policy and self.vllm_importance_sampling_correction is None:
            # TRL's default with vLLM, and ours with rollouts ahead of training: correct the sampler/trainer
            # mismatch (turn off with the TRL name).
            self.importance_sampling_correction = True
        _apply_aliases(self)
        if self.importance_sampling_mode is None:
            self.importance_sampling_mode = "sequence_mask" if self.rollout_mode == "sync" else "token_mask"
        if self.loss_type == "gspo":  # our alias; TRL spells GSPO as sequence-level ratios under the grpo loss
            self.loss_type, self.importance_sampling_level = "grpo", "sequence"
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        super().__post_init__()
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ConfigError(
                f"scale_rewards must be 'group', 'batch' or 'none', got {self.scale_rewards!r}"
                f"{closest(str(self.scale_rewards), ['group', 'batch', 'none'])}"
            )
        if self.epsilon <= 0:
            raise ConfigError(f"epsilon must be > 0, got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(
                f"epsilon_high ({self.epsilon_high}) must be >= epsilon ({self.epsilon}); clip-higher widens the upper range"
            )
        high = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        if self.delta is not None and self.delta <= 1 + high:
            raise ConfigError(f"delta ({self.delta}) must be > 1 + epsilon_high ({1 + high})")
        if self.beta < 0 or not math.isfinite(self.beta):
            raise ConfigError(f"beta must be a finite number >= 0, got {self.beta}")
        _positive(self, "tool_timeout", "tool_max_output_chars")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ConfigError(f"max_tool_calling_iterations must be null or >= 0, got {self.max_tool_calling_iterations}")

        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser {self.tool_call_parser!r} is unknown; registered parsers: "
                              f"{', '.join(sorted(TOOL_CALL_PARSERS))}{closest(self.tool_call_parser, list(TOOL_CALL_PARSERS))}")
        if self.num_iterations < 1:
            raise ConfigError(f"num_iterations must be >= 1, got {self.num_iterations}")

        if self.max_dynamic_sampling_rounds < 0:
            raise ConfigError(f"max_dynamic_sampling_rounds must be >= 0, got {self.max_dynamic_sampling_rounds}")
        self._check_loss_and_correction()

    def _check_loss_and_correction(self) -> None:
        """KL estimator, CISPO/SAPO parameters and the importance-sampling correction settings."""
        _check_choice("kl_estimator", self.kl_estimator, typing.get_args(KLEstimatorName))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        self._check_trl_algorithm_options()
        _check_choice("importance_sampling_mode", self.importance_sampling_mode, typing.get_args(ImportanceSamplingMode))
        for name in ("importance_sampling_clip_max", "importance_sampling_clip_min"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a finite number >= 0 or null, got {value}")
        lo, hi = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ConfigError(f"importance_sampling_clip_min ({lo}) must be less than importance_sampling_clip_max ({hi})")
        if self.importance_sampling_correction and self.importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
            raise ConfigError(
                f"importance_sampling_mode={self.importance_sampling_mode!r} truncates the ratio, so it needs "
                "importance_sampling_clip_max or importance_sampling_clip_min"
            )


    def _check_trl_algorithm_options(self) -> None:
        """VESPO, reward aggregation, token selection, adaptive entropy and reference-sync settings."""
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        REWARD_AGGREGATIONS.get(self.multi_objective_aggregation)
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator != "grpo":
            raise ConfigError(
                f"multi_objective_aggregation='normalize_then_sum' makes GDPO's advantages itself; it does not combine "
                f"with advantage_estimator={self.advantage_estimator!r}. Use advantage_estimator='grpo' or "
                "multi_objective_aggregation='sum_then_normalize'"
            )
        if self.off_policy_mask_threshold is not None and not math.isfinite(self.off_policy_mask_threshold):
            raise ConfigError(f"off_policy_mask_threshold must be a finite number or null, got {self.off_policy_mask_threshold}")
        check_quantile(self.top_entropy_quantile)
        if not 0 <= self.entropy_coef_min <= self.entropy_coef_max:
            raise ConfigError(f"need 0 <= entropy_coef_min ({self.entropy_coef_min}) <= entropy_coef_max "
                              f"({self.entropy_coef_max})")
        if self.entropy_coef_delta < 0:
            raise ConfigError(f"entropy_coef_delta must be >= 0, got {self.entropy_coef_delta}")
        if self.loss_type == "vespo" and self.importance_sampling_correction and \
                self.importance_sampling_mode.startswith("sequence"):
            raise ConfigError(
                f"loss_type='vespo' folds per-token importance-sampling weights into its gamma weight: "
                f"importance_sampling_mode must be token_truncate or token_mask, got {self.importance_sampling_mode!r}"
            )
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ConfigError(f"ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        _positive(self, "ref_model_sync_steps")
        if self.sync_ref_model and self.beta == 0:
            raise ConfigError(
                "sync_ref_model=True with beta=0.0: the reference model is not used, so there is nothing to "
                "synchronize; set beta > 0 or sync_ref_model=False"
            )


def _apply_aliases(cfg: Any) -> None:
    """Move values given under an alias name (fields with ``alias_of`` metadata, e.g. TRL's
    ``vllm_importance_sampling_mode``) onto their own field, then reset the alias to None so the
    config round-trips through ``to_dict``; a conflicting value under both names is an error."""
    for f in dataclasses.fields(cfg):
        target = f.metadata.get("alias_of")
        value = getattr(cfg, f.name)
        if target is None or value is None:
            continue
        target_field = next(t for t in dataclasses.fields(cfg) if t.name == target)
        current = getattr(cfg, target)
        if current != target_field.default and current != value:
            raise ConfigError(
                f"{f.name}={value!r} (TRL's name for {target}) conflicts with {target}={current!r}; set only one"
            )
        setattr(cfg, target, value)
        setattr(cfg, f.name, None)


@dataclass
class PPOConfig(BaseRLConfig):
    """PPO settings: the shared fields plus critic, KL-penalised token rewards and GAE."""

    learning_rate: float = _f(1e-5, "AdamW peak learning rate (policy and critic).")
    num_generations: int = _f(2, "Completions sampled per prompt (PPO needs no group; >= 2 keeps batches comparable).")
    epsilon: float = _f(0.2, "Policy ratio clipping range.")
    epsilon_high: float | None = _f(None, "Upper policy clipping range; null = epsilon.")
    kl_coef: float = _f(0.05, "Per-token KL penalty coefficient in the rewards.")
    adaptive_kl: bool = _f(False, "Adapt kl_coef towards target_kl (proportional controller).")
    target_kl: float = _f(6.0, "Target KL (sum over tokens) for the adaptive controller.")
    kl_horizon: int = _f(10000, "Horizon of the adaptive KL controller.")
    gamma: float = _f(1.0, "Discount factor for GAE.")
    lam: float = _f(0.95, "GAE lambda.")
    whiten_advantages: bool = _f(True, "Normalise advantages over valid tokens.")
    cliprange_value: float = _f(0.2, "Value clipping range around the old values.")
    vf_coef: float = _f(0.1, "Value loss coefficient.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.")
    ppo_epochs: int = _f(2, "Optimisation passes over each rollout batch.")
    num_mini_batches: int = _f(
        1, "Mini-batches (optimizer steps) per pass over a rollout batch; the rollout batch on each device is "
        "per_device_train_batch_size × gradient_accumulation_steps × num_mini_batches completions."
    )
    loss_type: str = _f("bnpo", "Policy-loss aggregation from the loss registry (bnpo = token mean per step, as PPO).")
    critic_init: Literal["policy", "reward_model"] = _f(
        "policy", "Critic backbone: the policy's frozen base with its own LoRA, or a reward model path."
    )
    critic_model: str | None = _f(None, "Reward-model path for critic_init='reward_model'.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma and lam must be in [0, 1], got gamma={self.gamma}, lam={self.lam}")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(f"epsilon_high ({self.epsilon_high}) must be >= epsilon ({self.epsilon})")
        _positive(self, "ppo_epochs", "num_mini_batches", "cliprange_value", "epsilon")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.critic_init == "reward_model" and not self.critic_model:
            raise ConfigError("critic_init='reward_model' needs critic_model: the reward model's path")

    @property
    def needs_reference_model(self) -> bool:
        """The KL penalty in the token rewards is on (``kl_coef > 0``)."""
        return self.kl_coef > 0

    @property
    def num_iterations(self) -> int:
        """Passes over each rollout batch, under the name the batch plan uses (= ppo_epochs)."""
        return self.ppo_epochs

    def resolved_steps_per_generation(self, world_size: int = 1) -> int:
        """Micro-batches per rollout batch on each device: num_mini_batches × gradient_accumulation_steps,
        unless steps_per_generation / generation_batch_size set it (then num_mini_batches must agree)."""
        if self.steps_per_generation is None and self.generation_batch_size is None:
            return self.num_mini_batches * self.gradient_accumulation_steps
        spg = super().resolved_steps_per_generation(world_size)
        if spg != self.num_mini_batches * self.gradient_accumulation_steps:
            raise ConfigError(
                f"num_mini_batches ({self.num_mini_batches}) disagrees with the rollout batch: {spg} micro-batches "
                f"per device / gradient_accumulation_steps {self.gradient_accumulation_steps} give "
                f"{spg / self.gradient_accumulation_steps:g} optimizer steps per pass; set num_mini_batches to that, "
                "or leave steps_per_generation and generation_batch_size unset"
            )
        return spg

