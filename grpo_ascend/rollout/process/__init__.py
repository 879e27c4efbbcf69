"""The built-in engine in a rollout process of its own, with its own copy of the policy (asynchronous rollouts)."""
