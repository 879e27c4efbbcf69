"""PPO on classic-control environments (gymnasium vector envs) with the LM path's buffer, GAE and losses."""

from grpo_ascend.rl.control import (
    ControlPPOConfig,
    GaussianActorCritic,
    evaluate_policy,
    random_policy_return,
    train_control_ppo,
)

__all__ = [
    "ControlPPOConfig",
    "GaussianActorCritic",
    "evaluate_policy",
    "random_policy_return",
    "train_control_ppo",
]
