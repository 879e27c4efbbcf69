"""examples/pendulum_ppo.py's code: PPO on classic-control environments (gymnasium vector envs) with an
on-device ring buffer and the LM path's GAE and losses."""

from grpo_ascend.examples_support.pendulum.control import (
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
