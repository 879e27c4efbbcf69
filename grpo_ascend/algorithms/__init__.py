"""Advantage estimators and policy/value losses, each behind a small registry."""

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

__all__ = [
    "ADVANTAGE_ESTIMATORS",
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
