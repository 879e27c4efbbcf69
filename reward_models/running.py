"""Running each function of a reward set on a batch, as TRL's GRPOTrainer calls it.

The check that a function takes the batch's keyword arguments, the sync and async calls under
``reward_timeout`` (:mod:`reward_models.timed_call`), the check of what comes back
(:mod:`reward_models.calling`), the per-completion calls that locate which completions make a
function raise, and the message naming them. :class:`~reward_models.reward_set.RewardSet` is built on
:class:`FunctionRunner` and decides what a failure does (``reward_errors``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_ascend.errors import GrpoAscendError, RewardError
from reward_models.calling import _Batch, _check_output
from reward_models.timed_call import _call_async, _call_sync, _Timeout


@dataclass
class _Result:
    """What one function produced for a batch: values (None = not applicable), the completions it
    raised on, a failure not attributable to one completion, or an error that always stops."""

    values: list[float | None]
    failures: dict[int, BaseException] = field(default_factory=dict)
    batch_error: BaseException | None = None
    fatal: GrpoAscendError | None = None
    seconds: float = 0.0


def _describe_exception(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class FunctionRunner:
    """Calls the functions of a set on a batch and collects each one's :class:`_Result`.

    The subclass sets ``funcs``, ``names``, ``reward_errors``, ``reward_timeout``, ``_dropped`` (the dataset
    columns each function does not take) and ``_signatures_ok`` (an empty set) in its ``__init__``.
    """

    funcs: list[Callable[..., Any]]
    names: list[str]
    reward_errors: str
    reward_timeout: float | None
    _dropped: list[frozenset[str]]
    _signatures_ok: set[tuple[int, frozenset[str]]]

    def _check_signature(self, j: int, keys: Sequence[str]) -> None:
        """RewardError when function j cannot take the TRL-style keyword call (checked once per
        set of column names)."""
        cache_key = (j, frozenset(keys))
        if cache_key in self._signatures_ok:
            return
        try:
            signature = inspect.signature(self.funcs[j])
        except (TypeError, ValueError):
            self._signatures_ok.add(cache_key)
            return
        try:
            signature.bind(**dict.fromkeys(keys))
        except TypeError as exc:
            raise RewardError(
                f"reward function {self.names[j]!r} cannot be called with this batch's keyword arguments "
                f"({', '.join(keys)}): {exc}. Reward functions are called as f(prompts=..., completions=..., "
                "completion_ids=..., <each dataset column>=..., trainer_state=...); name the columns you need "
                "as parameters and accept the rest with **kwargs"
            ) from None
        self._signatures_ok.add(cache_key)

    def _finish(self, j: int, batch: _Batch, out: Any, result: _Result) -> None:
        try:
            result.values = _check_output(self.names[j], out, batch.n)
        except GrpoAscendError as exc:
            result.fatal = exc

    def _after_failure(self, j: int, batch: _Batch, exc: BaseException) -> _Result | None:
        """Result for a failure that needs no per-completion retry (timeout, config error), else None."""
        if isinstance(exc, GrpoAscendError):
            return _Result([None] * batch.n, fatal=RewardError(f"reward function {self.names[j]!r}: {exc}"))
        if isinstance(exc, _Timeout):
            return _Result([None] * batch.n, batch_error=exc)
        return None

    def _single(self, j: int, i: int, out: Any, result: _Result) -> None:
        try:
            result.values[i] = _check_output(self.names[j], out, 1, offset=i)[0]
        except GrpoAscendError as exc:
            result.fatal = result.fatal or exc

    def _evaluate_sync(self, j: int, batch: _Batch) -> _Result:
        start = time.perf_counter()
        fn = self.funcs[j]
        result = _Result([None] * batch.n)
        try:
            out = _call_sync(fn, batch.kwargs(self._dropped[j]), self.reward_timeout)
        except Exception as exc:
            result = self._after_failure(j, batch, exc) or self._locate_sync(j, batch, exc)
        else:
            self._finish(j, batch, out, result)
        result.seconds = time.perf_counter() - start
        return result

    def _locate_sync(self, j: int, batch: _Batch, batch_exc: BaseException) -> _Result:
        """Call function j one completion at a time to find which completions make it raise."""
        result = _Result([None] * batch.n)
        for i in range(batch.n):
            try:
                out = _call_sync(self.funcs[j], batch.kwargs_for(i, self._dropped[j]), self.reward_timeout)
            except _Timeout as exc:  # too slow even alone: give up on the whole batch
                result.batch_error = exc
                break
            except Exception as exc:
                result.failures[i] = exc
                if self.reward_errors == "raise":
                    break
                continue
            self._single(j, i, out, result)
        if not result.failures and result.batch_error is None:
            result.batch_error = batch_exc
        return result

    async def _evaluate_async(self, j: int, batch: _Batch) -> _Result:
        start = time.perf_counter()
        fn = self.funcs[j]
        result = _Result([None] * batch.n)
        try:
            out = await _call_async(fn, batch.kwargs(self._dropped[j]), self.reward_timeout)
        except Exception as exc:
            result = self._after_failure(j, batch, exc)
            if result is None:
                result = _Result([None] * batch.n)
                outs = await asyncio.gather(
                    *(_call_async(fn, batch.kwargs_for(i, self._dropped[j]), self.reward_timeout) for i in range(batch.n)),
                    return_exceptions=True,
                )
                for i, single in enumerate(outs):
                    if isinstance(single, _Timeout):
                        result.batch_error = single
                    elif isinstance(single, BaseException):
                        result.failures[i] = single
                    else:
                        self._single(j, i, single, result)
                if not result.failures and result.batch_error is None:
                    result.batch_error = exc
        else:
            self._finish(j, batch, out, result)
        result.seconds = time.perf_counter() - start
        return result

    async def _evaluate_async_group(self, indices: list[int], batch: _Batch) -> list[_Result]:
        return list(await asyncio.gather(*(self._evaluate_async(j, batch) for j in indices)))

    def _error_message(self, j: int, batch: _Batch, result: _Result) -> str:
        name = self.names[j]
        fix = "fix the function, or set reward_errors: zero to score failing completions 0 and continue"
        if result.failures:
            i = min(result.failures)
            return (
                f"reward function {name!r} raised {_describe_exception(result.failures[i])} on completion {i} "
                f"(of {batch.n}; completion text {batch.describe(i)}); {fix}"
            )
        exc = result.batch_error
        if isinstance(exc, _Timeout):
            return (
                f"reward function {name!r} did not return within reward_timeout={self.reward_timeout:g}s for a "
                f"batch of {batch.n} completions; raise reward_timeout or make the function faster (a timed-out "
                "sync function keeps running in its worker thread: Python threads cannot be killed)"
            )
        return (
            f"reward function {name!r} raised {_describe_exception(exc)} on the batch of {batch.n} completions, "
            f"but on none of them alone (it may depend on the whole batch); {fix}"
        )
