"""Rollout: grouped sampling of completions and the on-device rollout buffer."""
