"""Environments that own their data (TRL 1.16's ``environment_factory`` without a ``train_dataset``).

When every rollout's environment supplies its prompt from ``reset()``, ``train_dataset`` may be left out:
the run then draws from a placeholder set of empty user messages (one generation round's rows, cycled)
and ``max_steps`` gives its length. Rows of a dataset without a ``prompt`` column (a routing set with only
an ``environment`` column) start from the same empty message (grpo_ascend/data/prompts.py's ``row_prompt``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_ascend.data.prompts import EMPTY_PROMPT
from grpo_ascend.errors import ConfigError

#: TRL 1.16's words for a run that cannot do without a train set.
SEVERAL_ENVIRONMENTS_NEED_DATA = (
    "A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an `environment` "
    "column to route each example to its environment. Provide a dataset, or pass a single environment factory."
)
MAX_STEPS_NEEDED = (
    "When training without a `train_dataset` (the environment owns the data and returns the prompt from "
    "`reset()`), `max_steps` must be set to a positive value to define the training length. Set it via "
    "`GRPOConfig(max_steps=...)`."
)


def environment_train_dataset(train_dataset: Any, environment_factory: Any, args: Any) -> Any:
    """The train set a GRPO run draws from: ``train_dataset`` when given (or when there is no environment:
    the trainer then refuses None); else, for one environment factory and ``max_steps`` > 0, a placeholder of
    ``EMPTY_PROMPT`` rows, as many as one generation round's prompts on one process (at least 1).
    ConfigError with TRL's message for a dict of factories or ``max_steps`` <= 0."""
    if train_dataset is not None or environment_factory is None:
        return train_dataset
    if isinstance(environment_factory, Mapping):
        raise ConfigError(SEVERAL_ENVIRONMENTS_NEED_DATA)
    if args.max_steps <= 0:
        raise ConfigError(f"{MAX_STEPS_NEEDED} (got max_steps={args.max_steps})")
    from datasets import Dataset

    rows = max(1, args.batch_plan().prompts_per_generation)
    return Dataset.from_dict({"prompt": [[dict(m) for m in EMPTY_PROMPT] for _ in range(rows)]})
