"""Trainers: GRPO and PPO, sharing the rollout engine, rewards and losses."""
