"""Advantage estimators (group-relative, PPO's token advantages), policy/value losses, KL estimators and
importance-sampling correction."""

from grpo_ascend.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageOutput,
    compute_advantages,
    grpo_advantages,
    normalize_scale_rewards,
    rloo_advantages,
    select_informative_groups,
)
from grpo_ascend.algorithms.gae import discounted_reverse_cumsum, gae_advantages, gae_advantages_env, whiten
from grpo_ascend.algorithms.importance_sampling import (
    IMPORTANCE_SAMPLING_MODES,
    ImportanceSamplingSettings,
    ImportanceWeights,
    importance_sampling_metrics,
    importance_sampling_weights,
    reduce_stats,
)
from grpo_ascend.algorithms.kl import KL_ESTIMATORS, per_token_kl
from grpo_ascend.algorithms.losses import (
    POLICY_LOSSES,
    LossNormaliser,
    PolicyLossBatch,
    PolicyLossSettings,
    per_token_policy_loss,
    policy_loss,
    ppo_policy_loss,
    ppo_value_loss,
)
from grpo_ascend.algorithms.registry import Registry
from grpo_ascend.algorithms.token_advantages import (
    TOKEN_ADVANTAGE_ESTIMATORS,
    TokenAdvantages,
    gae_token_advantages,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IMPORTANCE_SAMPLING_MODES",
    "KL_ESTIMATORS",
    "TOKEN_ADVANTAGE_ESTIMATORS",
    "TokenAdvantages",
    "gae_token_advantages",
    "ImportanceSamplingSettings",
    "ImportanceWeights",
    "importance_sampling_metrics",
    "importance_sampling_weights",
    "reduce_stats",
    "per_token_kl",
    "POLICY_LOSSES",
    "AdvantageOutput",
    "LossNormaliser",
    "PolicyLossBatch",
    "PolicyLossSettings",
    "Registry",
    "compute_advantages",
    "discounted_reverse_cumsum",
    "gae_advantages",
    "gae_advantages_env",
    "grpo_advantages",
    "normalize_scale_rewards",
    "per_token_policy_loss",
    "policy_loss",
    "ppo_policy_loss",
    "ppo_value_loss",
    "rloo_advantages",
    "select_informative_groups",
    "whiten",
]
