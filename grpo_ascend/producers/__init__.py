"""Where a trainer's scored completions come from: sampled in lockstep with training, or by a producer ahead of it."""
