"""transformers' data-loading fields that TRL 1.16's ``GRPOConfig`` inherits (``dataloader_num_workers``,
``accelerator_config``) and TRL's rules for streamed (iterable) datasets.

The trainer draws prompts with its own seeded, resumable sampler, not a ``DataLoader``: neither field starts
worker processes or changes accelerate's batching. They are kept, checked and adjusted as TRL adjusts them, so a
script that sets or reads them back sees TRL's values: a streamed train set needs one reader
(``dataloader_num_workers`` becomes 0, with TRL's warning; a map-style train set keeps its value, also when the
eval set is a stream), and any stream needs ``accelerator_config.dispatch_batches`` false (true is TRL's error;
unset becomes false).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_ascend.errors import ConfigError, closest

logger = logging.getLogger(__name__)

DISPATCH_BATCHES_ERROR = ("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                          "`accelerator_config`. Please set it to `False`.")


@dataclass
class AcceleratorConfig:
    """transformers' ``AcceleratorConfig`` options (same names and defaults). Only ``dispatch_batches`` is read
    (TRL's rule for streams, above); the others have no effect here, there being no accelerate DataLoader."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = True
    non_blocking: bool = False
    gradient_accumulation_kwargs: dict[str, Any] | None = None
    use_configured_state: bool = False


def accelerator_config(value: Any) -> AcceleratorConfig:
    """``accelerator_config`` as an :class:`AcceleratorConfig`, from None, a mapping, a JSON file's path, ours or
    transformers' object (as transformers reads it); an unknown key is an error naming the known ones."""
    if isinstance(value, AcceleratorConfig):
        return value
    if value is None:
        return AcceleratorConfig()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif isinstance(value, (str, Path)):
        try:
            value = json.loads(Path(value).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"accelerator_config {str(value)!r}: expected a readable JSON file of accelerator "
                              f"options ({exc})") from exc
    if not isinstance(value, Mapping):
        raise ConfigError(f"accelerator_config: expected a mapping of accelerator options, a JSON file's path or an "
                          f"AcceleratorConfig, got {type(value).__name__}")
    names = [f.name for f in dataclasses.fields(AcceleratorConfig)]
    for key in value:
        if key not in names:
            raise ConfigError(f"accelerator_config: unknown option {key!r}{closest(str(key), names)}; the options "
                              f"are {', '.join(names)}")
    return AcceleratorConfig(**value)


def _is_stream(dataset: Any) -> bool:
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__len__")


def check_stream_dispatch(args: Any, dataset: Any) -> None:
    """TRL's rule for a streamed ``dataset`` (one set, or a dict of them): ``dispatch_batches`` must not be true;
    unset, it becomes false."""
    parts = dataset.values() if isinstance(dataset, Mapping) else [dataset]
    if not any(_is_stream(part) for part in parts):
        return
    if args.accelerator_config.dispatch_batches:
        raise ConfigError(DISPATCH_BATCHES_ERROR)
    args.accelerator_config.dispatch_batches = False


def apply_stream_rules(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """TRL 1.16's adjustments when the trainer is built: ``dispatch_batches`` for any stream, one reader for a
    streamed train set (``args`` is changed in place, as TRL changes its config)."""
    check_stream_dispatch(args, train_dataset)
    if eval_dataset is not None:
        check_stream_dispatch(args, eval_dataset)
    if _is_stream(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning("Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding "
                       "the provided value (%s).", args.dataloader_num_workers)
        args.dataloader_num_workers = 0
