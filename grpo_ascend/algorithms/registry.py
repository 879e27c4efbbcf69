"""A tiny name → object registry, so configs can pick estimators and losses by string."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from grpo_ascend.errors import ConfigError, closest

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects; ``get`` of an unknown name raises a ConfigError listing the valid ones.

    ``kind`` is the human word used in error messages, e.g. "loss_type".
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering the decorated object under ``name`` (returns it unchanged)."""

        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """Return the object registered as ``name``; ConfigError naming the valid choices otherwise."""
        try:
            return self._items[name]
        except (KeyError, TypeError):
            valid = ", ".join(sorted(self._items))
            hint = closest(name, self._items) if isinstance(name, str) else ""
            raise ConfigError(f"unknown {self.kind} {name!r}{hint}; valid values: {valid}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
