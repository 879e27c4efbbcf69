"""TRL's calling convention for reward functions: the keyword arguments one call gets, and the check of
what it returns.

    f(prompts=prompts, completions=completions, completion_ids=completion_ids,
      **columns, trainer_state=trainer_state) -> list[float | None]

with one entry per completion in every list; ``log_metric`` / ``log_extra`` are passed only to
functions that take them. ``None`` means "not applicable".
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from grpo_ascend.errors import RewardError
from reward_models.text import completion_text

# Dataset columns TRL does not forward to reward functions, and names the call itself uses.
_DROPPED_COLUMNS = ("prompt", "completion", "completion_ids")
_RESERVED_COLUMNS = ("prompts", "completions", "trainer_state", "log_metric", "log_extra")
#: Keyword arguments TRL 1.16 also passes (``log_metric(name, value)``, ``log_extra(column, values)``);
#: a function gets each only if it names it or takes ``**kwargs``, so older functions keep working.
OPTIONAL_KWARGS = ("log_metric", "log_extra")


def _optional_dropped(fn: Callable[..., Any]) -> frozenset[str]:
    """The optional keyword arguments ``fn`` cannot take (neither named nor covered by ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset()
    names = {p.name for p in params}
    return frozenset(k for k in OPTIONAL_KWARGS if k not in names)


class TrainerStateView(dict):
    """The ``trainer_state`` passed to reward functions: a dict (``step``, ``epoch``, ...) whose keys
    also read as attributes, with ``global_step`` mirroring ``step``, so functions written for TRL
    (which passes a ``transformers.TrainerState``) can use ``trainer_state.global_step`` unchanged."""

    def __init__(self, state: Mapping[str, Any] | None = None) -> None:
        super().__init__({"step": 0, "epoch": 0.0} if state is None else state)
        if "step" in self and "global_step" not in self:
            self["global_step"] = self["step"]
        elif "global_step" in self and "step" not in self:
            self["step"] = self["global_step"]

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"trainer_state has no {name!r}; it has {sorted(self)}") from None


@dataclass
class _Batch:
    """The arguments of one reward call, with per-function copies so one function cannot mutate
    the lists another one sees."""

    prompts: list
    completions: list
    completion_ids: list
    columns: dict[str, list]
    state: Any
    optional: dict[str, Any]

    @property
    def n(self) -> int:
        return len(self.completions)

    def kwargs(self, drop: frozenset[str] = frozenset()) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompts": list(self.prompts),
            "completions": list(self.completions),
            "completion_ids": [list(ids) for ids in self.completion_ids],
        }
        out.update({k: list(v) for k, v in self.columns.items()})
        out["trainer_state"] = self.state
        out.update({k: v for k, v in self.optional.items() if k not in drop})
        return out

    def kwargs_for(self, i: int, drop: frozenset[str] = frozenset()) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompts": [self.prompts[i]],
            "completions": [self.completions[i]],
            "completion_ids": [list(self.completion_ids[i])],
        }
        out.update({k: [v[i]] for k, v in self.columns.items()})
        out["trainer_state"] = self.state
        out.update({k: v for k, v in self.optional.items() if k not in drop})
        return out

    def describe(self, i: int) -> str:
        try:
            text = completion_text(self.completions[i])
        except RewardError:
            text = repr(self.completions[i])
        return repr(text if len(text) <= 80 else text[:77] + "...")


def _check_output(name: str, out: Any, n: int, offset: int = 0) -> list[float | None]:
    """Validate a reward function's return value: n finite numbers or None."""
    if isinstance(out, torch.Tensor):
        if out.dim() != 1:
            raise RewardError(
                f"reward function {name!r} returned a tensor of shape {tuple(out.shape)}; expected a list "
                f"(or 1-D tensor) of {n} values, one per completion"
            )
        out = out.detach().float().tolist()
    elif hasattr(out, "tolist") and getattr(out, "ndim", None) is not None:
        if out.ndim != 1:
            raise RewardError(
                f"reward function {name!r} returned an array of shape {tuple(out.shape)}; expected a list "
                f"(or 1-D array) of {n} values, one per completion"
            )
        out = out.tolist()
    if out is None or isinstance(out, (str, bytes, Mapping, set, frozenset)) or not hasattr(out, "__iter__"):
        raise RewardError(
            f"reward function {name!r} returned {type(out).__name__}; expected a list of {n} values "
            "(float, or None for 'not applicable'), one per completion"
        )
    values = list(out)
    if len(values) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} completions; expected exactly one "
            "value (float, or None for 'not applicable') per completion, in order"
        )
    checked: list[float | None] = []
    for j, value in enumerate(values):
        if value is None:
            checked.append(None)
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        elif (
            not isinstance(value, numbers.Real)
            and hasattr(value, "item")
            and getattr(value, "size", None) == 1
        ):
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward function {name!r} returned a non-numeric value {value!r} ({type(value).__name__}) for "
                f"completion {offset + j}; expected a float, or None for 'not applicable'"
            )
        number = float(value)
        if not math.isfinite(number):
            raise RewardError(
                f"reward function {name!r} returned {number} for completion {offset + j}; rewards must be finite "
                "(return None to mark a completion as not applicable)"
            )
        checked.append(number)
    return checked
