"""Pieces shared by the trainer tests: a quickly learnable reward and a small-run config."""

from __future__ import annotations

# Settings of a short, cheap run on the tiny model (each test overrides what it checks).
SMALL_RUN = dict(
    num_generations=4, per_device_train_batch_size=8, max_completion_length=10, max_prompt_length=96,
    learning_rate=5e-3, max_steps=2, save_steps=0, logging_steps=1, disable_tqdm=True, log_completions_steps=0,
    seed=0, lr_scheduler_type="constant", length_bucket=16,
)


def first_digit_is_one(prompts, completions, **kwargs):
    """A pattern the warm-started policy learns quickly: answers that start with the digit 1."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.strip().removeprefix("<answer>").startswith("1") else 0.0 for t in texts]
