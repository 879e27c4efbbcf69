"""Models and log-probs: loading the policy, LoRA and the adapter-disabled reference, chunked log-prob
forwards, our attention kernels, PPO's critic, and the built-in tiny models with their shipped warm starts."""
