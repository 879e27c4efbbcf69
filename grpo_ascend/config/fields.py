"""The machinery the config dataclasses are built from: fields with help text, typed validation.

``_f`` declares a field with its help text (the config reference is generated from it);
``_Validated`` builds a dataclass from a mapping (a YAML recipe, overrides), rejecting unknown or
removed keys and wrong types with one clear :class:`ConfigError` line; ``_positive`` and
``_check_choice`` are the small range checks the configs' ``__post_init__`` share.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal, TypeVar, Union

from grpo_ascend.errors import ConfigError, closest

T = TypeVar("T", bound="_Validated")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


#: Settings that were removed, with why; a config naming one gets this instead of "unknown key".
REMOVED_KEYS = {
    "rollout_buffer_size": "LM PPO trains on each rollout batch as it is made, so a buffer capacity changed "
    "nothing; remove the key",
}


def _unknown_key(source: str, key: str, names: Any) -> ConfigError:
    if key in REMOVED_KEYS:
        return ConfigError(f"{source}: {key!r} was removed: {REMOVED_KEYS[key]}")
    return ConfigError(f"{source}: unknown key {key!r}{closest(key, names)}")


class _Validated:
    """Mixin: typed construction from dicts and YAML with helpful errors."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[T], values: dict[str, Any], source: str = "config") -> T:
        """Build from a mapping, rejecting unknown keys (with the closest valid name) and wrong types."""
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a mapping of settings, got {type(values).__name__}")
        names = cls.field_names()
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in names:
                raise _unknown_key(source, key, names)
            kwargs[key] = _coerce(value, hints[key], f"{source}: {key}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check ``value`` against a type hint; int→float and int/str→bool-free conversions only."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: expected {_type_name(hint)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(
            f"{where}: expected one of {list(args)}, got {value!r}{closest(str(value), [str(a) for a in args])}"
        )
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_coerce(v, inner, where) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads "1e-5" as a string
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


_FRIENDLY = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _type_name(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    names = []
    for a in args:
        if typing.get_origin(a) is Literal:
            names.append(" | ".join(repr(x) for x in typing.get_args(a)))
        else:
            names.append(_FRIENDLY.get(a, getattr(a, "__name__", str(a))))
    optional = " or null" if type(None) in typing.get_args(hint) else ""
    return " or ".join(names) + optional


def _positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ConfigError(
            f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}{closest(str(value), map(str, choices))}"
        )
