"""RewardSet: call every reward function exactly as TRL's GRPOTrainer does, check what comes back,
and combine the results into one weighted reward per completion.

The calling convention and the check of each return value are in :mod:`reward_models.calling`;
running one call under ``reward_timeout`` (sync or async) in :mod:`reward_models.timed_call`;
running each function on a batch and locating failing completions in :mod:`reward_models.running`.
``None`` from a function means "not applicable": it becomes NaN in ``per_function`` and is left
out of that completion's weighted sum.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from grpo_ascend.errors import ConfigError, DataError, RewardError, closest
from reward_models.calling import (
    _DROPPED_COLUMNS,
    _RESERVED_COLUMNS,
    TrainerStateView,
    _Batch,
    _optional_dropped,
)
from reward_models.loading import load_reward_function, reward_name
from reward_models.reward_output import RewardOutput
from reward_models.running import FunctionRunner, _Result
from reward_models.timed_call import _background_loop, _is_async, _Timeout

logger = logging.getLogger(__name__)

REWARD_ERROR_MODES = ("raise", "zero")


def processing_classes_per_function(classes: Any, count: int) -> list[Any]:
    """TRL's ``reward_processing_classes`` as one entry per reward function: None (all None), one
    tokenizer (for one function) or a list as long as ``reward_funcs``."""
    if classes is None:
        return [None] * count
    entries = list(classes) if isinstance(classes, (list, tuple)) else [classes]
    if len(entries) != count:
        raise ConfigError(
            f"The number of reward processing classes ({len(entries)}) must match the number of reward functions "
            f"({count}): give one entry per reward function, in the same order (None where unused)"
        )
    return entries


class RewardSet(FunctionRunner):
    """Several reward functions, their weights, and how to treat failures.

    ``reward_funcs`` is one spec or a list (see :func:`load_reward_function`); ``reward_weights``
    one number per function (default all 1.0). ``reward_errors="raise"`` stops at the first
    function that raises, naming it, the exception and the completion index; ``"zero"`` scores the
    failing completions 0, logs a warning once per function and counts them. Invalid return values
    (wrong length, non-numeric, NaN/inf) and configuration errors always raise.
    ``reward_timeout`` (seconds) bounds each call; a timed-out sync function cannot be stopped
    (Python threads cannot be killed) and keeps running in its daemon worker thread, its result
    discarded. Output tensors go to ``device`` (None: CPU) in one host-to-device copy; reward models
    given as strings load on ``device`` (None: the automatic device choice). ``processing_class``
    is the tokenizer a loaded reward model falls back on when it came without its own;
    ``reward_processing_classes`` (TRL's argument: one tokenizer, or one entry per function) gives a
    reward model the tokenizer it scores with; None entries and entries of other functions are unused.
    """

    def __init__(
        self,
        reward_funcs: Any,
        reward_weights: Sequence[float] | None = None,
        reward_errors: str = "raise",
        reward_timeout: float | None = None,
        device: str | torch.device | None = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
    ) -> None:
        specs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not specs:
            raise ConfigError("reward_funcs is empty; give at least one reward function")
        per_function = processing_classes_per_function(reward_processing_classes, len(specs))
        if reward_errors not in REWARD_ERROR_MODES:
            raise ConfigError(
                f"reward_errors must be one of {list(REWARD_ERROR_MODES)}, got {reward_errors!r}"
                f"{closest(str(reward_errors), REWARD_ERROR_MODES)}"
            )
        if reward_timeout is not None and (
            isinstance(reward_timeout, bool)
            or not isinstance(reward_timeout, (int, float))
            or not math.isfinite(reward_timeout)
            or reward_timeout <= 0
        ):
            raise ConfigError(
                f"reward_timeout must be a positive number of seconds or null, got {reward_timeout!r}"
            )
        self.device = torch.device(device) if device is not None else None
        self.funcs: list[Callable[..., Any]] = [
            load_reward_function(spec, device=self.device, processing_class=processing_class,
                                 reward_processing_class=own)
            for spec, own in zip(specs, per_function)
        ]
        self.names: list[str] = _unique_names([reward_name(f) for f in self.funcs])
        self.weights: list[float] = self._weights(reward_weights)
        self.reward_errors = reward_errors
        self.reward_timeout = float(reward_timeout) if reward_timeout is not None else None
        self.total_error_counts: dict[str, int] = dict.fromkeys(self.names, 0)
        self._async = [_is_async(f) for f in self.funcs]
        self._dropped = [_optional_dropped(f) for f in self.funcs]
        self._signatures_ok: set[tuple[int, frozenset[str]]] = set()
        self._warned: set[str] = set()

    def _weights(self, weights: Sequence[float] | None) -> list[float]:
        if weights is None:
            return [1.0] * len(self.funcs)
        values = weights.tolist() if isinstance(weights, torch.Tensor) else list(weights)
        if len(values) != len(self.funcs):
            raise ConfigError(
                f"reward_weights has {len(values)} values for {len(self.funcs)} reward functions ({', '.join(self.names)}); "
                "give one weight per function, in the same order"
            )
        for name, w in zip(self.names, values):
            if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(float(w)):
                raise ConfigError(
                    f"reward_weights: the weight of {name!r} must be a finite number, got {w!r}"
                )
        return [float(w) for w in values]

    def __len__(self) -> int:
        return len(self.funcs)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}×{w:g}" for n, w in zip(self.names, self.weights))
        return (
            f"RewardSet({parts}, reward_errors={self.reward_errors!r}, reward_timeout={self.reward_timeout})"
        )

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: dict[str, list] | None = None,
        trainer_state: dict | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
    ) -> RewardOutput:
        """Score N completions with every function and combine them (see :class:`RewardOutput`).

        ``columns`` holds the extra dataset columns, one entry per completion (``prompt``,
        ``completion`` and ``completion_ids`` columns are dropped, as TRL does). ``trainer_state``
        (``step``, ``epoch``) reaches the functions as a :class:`TrainerStateView`; None gives step 0.
        ``log_metric(name, value)`` / ``log_extra(column, values)`` reach the functions that take them
        (TRL 1.16's names: a scalar averaged into the step's metrics, a column of samples.jsonl).
        """
        batch = self._batch(prompts, completions, completion_ids, columns, trainer_state)
        batch.optional = {k: v for k, v in (("log_metric", log_metric), ("log_extra", log_extra)) if v is not None}
        for j in range(len(self.funcs)):
            self._check_signature(j, list(batch.kwargs(self._dropped[j])))
        results: list[_Result | None] = [None] * len(self.funcs)
        if batch.n:
            async_idx = [j for j, a in enumerate(self._async) if a]
            pending = None
            if async_idx:
                pending = asyncio.run_coroutine_threadsafe(
                    self._evaluate_async_group(async_idx, batch), _background_loop()
                )
            try:
                for j, is_async in enumerate(self._async):
                    if not is_async:
                        results[j] = self._evaluate_sync(j, batch)
            finally:
                if pending is not None:
                    for j, result in zip(async_idx, pending.result()):
                        results[j] = result
        return self._combine(batch, results)

    def _batch(
        self, prompts: list, completions: list, completion_ids: list, columns: Any, trainer_state: Any
    ) -> _Batch:
        n = len(completions)
        for label, seq in (("prompts", prompts), ("completion_ids", completion_ids)):
            if len(seq) != n:
                raise DataError(
                    f"rewards: got {len(seq)} {label} for {n} completions; pass one per completion"
                )
        cleaned: dict[str, list] = {}
        for key, value in (columns or {}).items():
            if key in _DROPPED_COLUMNS:
                continue
            if key in _RESERVED_COLUMNS:
                raise DataError(
                    f"dataset column {key!r} clashes with the reward call's own argument of that name; rename the column"
                )
            if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != n:
                got = (
                    len(value)
                    if hasattr(value, "__len__") and not isinstance(value, (str, bytes))
                    else type(value).__name__
                )
                raise DataError(
                    f"rewards: column {key!r} has {got} entries for {n} completions; each column needs one entry per "
                    "completion (repeat a prompt's value for each of its generations)"
                )
            cleaned[key] = list(value)
        state = (
            trainer_state
            if trainer_state is not None and not isinstance(trainer_state, Mapping)
            else TrainerStateView(trainer_state)
        )
        return _Batch(list(prompts), list(completions), list(completion_ids), cleaned, state, {})

    def _combine(self, batch: _Batch, results: list[_Result | None]) -> RewardOutput:
        n, f = batch.n, len(self.funcs)
        for result in results:
            if result is not None and result.fatal is not None:
                raise result.fatal
        error_counts = dict.fromkeys(self.names, 0)
        columns: list[list[float]] = []
        for j, result in enumerate(results):
            if result is None:
                columns.append([])
                continue
            failed = set(range(n)) if result.batch_error is not None else set(result.failures)
            if failed:
                if self.reward_errors == "raise":
                    raise RewardError(self._error_message(j, batch, result))
                self._warn_zero(j, batch, result, len(failed))
                error_counts[self.names[j]] = len(failed)
                self.total_error_counts[self.names[j]] += len(failed)
            columns.append(
                [0.0 if i in failed else (math.nan if v is None else v) for i, v in enumerate(result.values)]
            )
        per = torch.tensor(columns, dtype=torch.float32).reshape(f, n).T if n else torch.empty(0, f)
        weights = torch.tensor(self.weights, dtype=torch.float32)
        total = torch.nansum(per * weights, dim=1)
        all_none = int(torch.isnan(per).all(dim=1).sum()) if f else n
        if all_none and "__all_none__" not in self._warned:
            self._warned.add("__all_none__")
            row = int(torch.isnan(per).all(dim=1).nonzero()[0]) if f else 0
            example = {**{k: v[row] for k, v in batch.columns.items()}, "prompt": batch.prompts[row],
                       "completion": batch.completions[row]}
            # TRL 1.16's wording first (users and TRL's tests match it), then what happens here and how often
            logger.warning(
                "All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at least one "
                "reward function returns a valid reward. (%d of %d completions of this batch, reward functions %s; "
                "such a completion's total reward is 0; warned once per run.)",
                example,
                all_none,
                n,
                ", ".join(self.names),
            )
        flat = torch.cat([per.reshape(-1), total])
        if self.device is not None and flat.device != self.device:
            flat = flat.to(self.device)
        seconds = {name: (r.seconds if r is not None else 0.0) for name, r in zip(self.names, results)}
        return RewardOutput(
            per_function=flat[: n * f].view(n, f),
            total=flat[n * f :],
            names=list(self.names),
            error_counts=error_counts,
            seconds=seconds,
            all_none=all_none,
        )

    def _warn_zero(self, j: int, batch: _Batch, result: _Result, count: int) -> None:
        name = self.names[j]
        if name in self._warned:
            return
        self._warned.add(name)
        exc = result.failures[min(result.failures)] if result.failures else result.batch_error
        logger.warning(
            "%s. Scoring %d of %d completions 0 (reward_errors=zero); further errors from %r are only counted "
            "(rewards/%s/errors)",
            self._error_message(j, batch, result),
            count,
            batch.n,
            name,
            name,
            exc_info=exc if not isinstance(exc, _Timeout) else None,
        )


def _unique_names(names: list[str]) -> list[str]:
    """Suffix repeated names: ``accuracy, accuracy`` -> ``accuracy, accuracy_2``."""
    seen: set[str] = set()
    out = []
    for name in names:
        candidate, k = name, 1
        while candidate in seen:
            k += 1
            candidate = f"{name}_{k}"
        seen.add(candidate)
        out.append(candidate)
    return out
