"""The classification of TRL 1.16's ``GRPOConfig`` fields (:mod:`grpo_ascend.config.trl_fields`) applied to values:
one pass that both ways of bringing TRL settings in share, so they cannot disagree.

- :func:`grpo_ascend.config.trl_compat.from_trl_config`: a ``trl.GRPOConfig`` object (TRL's defaults included);
- :func:`own_keywords`: TRL field names given to our own ``GRPOConfig(...)`` as keywords, e.g.
  ``GRPOConfig(use_liger_kernel=False, dataloader_num_workers=2)``. Our own fields keep their meaning; a TRL
  field we do not have counts only when it differs from TRL's declared default (:mod:`grpo_ascend.config.trl_defaults`):
  a supported one is moved onto our settings (over our own field of the same meaning, as TRL's newer name wins
  in TRL), an ignored one draws one :class:`TRLConfigWarning` listing them all, a refused one one
  :class:`~grpo_ascend.errors.ConfigError` listing each with why.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

from grpo_ascend.config.trl_defaults import TRL_DEFAULTS
from grpo_ascend.config.trl_fields import TRL_FIELDS
from grpo_ascend.config.trl_mapping import plain
from grpo_ascend.errors import ConfigError, closest

DOC = "docs/trl_compatibility.md"


class TRLConfigWarning(UserWarning):
    """Settings of a TRL config that have no effect here."""


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def differs(value: Any, default: Any) -> bool:
    """Whether a TRL field's ``value`` differs from its ``default`` (None and empty containers are the same)."""
    value, default = plain(value), plain(default)
    if _empty(value) and _empty(default):
        return False
    try:
        return bool(value != default)
    except Exception:  # objects without a usable ==: compare their text
        return repr(value) != repr(default)


def show(value: Any) -> str:
    text = repr(plain(value))
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass
class Classified:
    """TRL settings sorted by the classification: our settings for the supported ones, and the rest listed."""

    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    ignored: list[str] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    unknown: list[str] = dataclasses.field(default_factory=list)

    def report(self, source: str, stacklevel: int) -> None:
        """One ConfigError listing every refused setting, else one TRLConfigWarning for the ignored/unknown ones
        (``stacklevel`` counts from the caller: 1 is the caller itself)."""
        if self.refused:
            raise ConfigError(
                f"{source}: {len(self.refused)} setting(s) are not supported by grpo-ascend (see {DOC}); leave them at "
                "TRL's defaults:\n  " + "\n  ".join(self.refused)
            )
        parts = []
        if self.ignored:
            parts.append(f"{len(self.ignored)} setting(s) have no effect here and are ignored: {', '.join(self.ignored)}")
        if self.unknown:
            parts.append(f"{len(self.unknown)} setting(s) are unknown to grpo-ascend (not in TRL 1.16) and are ignored: "
                         f"{', '.join(self.unknown)}")
        if parts:
            warnings.warn(f"{source}: {'; '.join(parts)} (see {DOC})", TRLConfigWarning, stacklevel=stacklevel + 1)


def classify(values: Iterable[tuple[str, Any]], changed: Callable[[str, Any], bool], view: Any,
             convert_unchanged: bool) -> Classified:
    """Sort TRL ``(name, value)`` pairs. ``changed(name, value)``: whether the value counts as set (only set ignored
    and refused fields are listed); ``convert_unchanged``: whether supported fields are converted even when not
    set (a TRL config means TRL's defaults). ``view``: the whole TRL config as the converters read it."""
    out = Classified()
    for name, value in values:
        entry = TRL_FIELDS.get(name)
        is_set = changed(name, value)
        if entry is None:
            if is_set:
                out.unknown.append(f"{name}={show(value)}")
        elif entry.kind == "mapped":
            if not (is_set or convert_unchanged):
                continue
            try:
                out.settings.update(entry.settings(name, value, view))
            except ConfigError as exc:
                out.refused.append(str(exc).removeprefix("trl.GRPOConfig "))
        elif is_set and entry.kind == "ignored":
            out.ignored.append(f"{name}={show(value)}")
        elif is_set:
            out.refused.append(f"{name}={show(value)}: {entry.note}")
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def own_keywords(config_cls: type, kwargs: dict[str, Any], stacklevel: int = 2) -> dict[str, Any]:
    """``kwargs`` for ``config_cls``'s dataclass ``__init__``: its own fields as given, TRL 1.16 fields it does not
    have classified (see the module docstring). A name that is neither raises TypeError, as Python would."""
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    foreign = {k: v for k, v in kwargs.items() if k not in fields}
    if not foreign:
        return kwargs
    unknown = [k for k in foreign if k not in TRL_FIELDS]
    if unknown:
        raise TypeError(f"{config_cls.__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}"
                        f"{closest(unknown[0], [*fields, *TRL_FIELDS])}")
    view = SimpleNamespace(**{**TRL_DEFAULTS, **{n: _default(f) for n, f in fields.items()}, **kwargs})
    result = classify(foreign.items(), lambda n, v: n not in TRL_DEFAULTS or differs(v, TRL_DEFAULTS[n]), view,
                      convert_unchanged=False)
    result.report(config_cls.__name__, stacklevel + 1)
    return {**{k: v for k, v in kwargs.items() if k in fields}, **result.settings}
