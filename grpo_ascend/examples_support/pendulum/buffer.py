"""On-device ring buffer for PPO-style rollouts.

Storage is preallocated once per named field ([capacity, *shape], fixed dtype) on one device,
so adding and reading never reallocates and data never leaves the device: ``add`` scatters a
batch at ``(pointer + arange(n)) % capacity`` and reads gather rows with index arithmetic done
on the device. Only the pointer and the fill count (plain ints) live on the host.
Positions seen by ``get`` are *logical*: 0 is the oldest item still held, ``size − 1`` the newest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_ascend.errors import ConfigError, DataError


@dataclass(frozen=True)
class FieldSpec:
    """Per-item shape (without the leading batch dim) and dtype of one buffer field."""

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32


class RolloutBuffer:
    """Fixed-capacity FIFO of named tensors; the oldest items are overwritten when full."""

    def __init__(
        self,
        capacity: int,
        fields: Mapping[str, FieldSpec | tuple[tuple[int, ...], torch.dtype]],
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"buffer capacity must be a positive int, got {capacity!r}")
        if not fields:
            raise ConfigError("a rollout buffer needs at least one field")
        self.capacity = capacity
        self.device = torch.empty(0).device if device is None else torch.device(device)
        self.specs: dict[str, FieldSpec] = {}
        for name, spec in fields.items():
            if not isinstance(spec, FieldSpec):
                try:
                    shape, dtype = spec
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"field {name!r}: expected FieldSpec or (shape, dtype), got {spec!r}"
                    ) from None
                spec = FieldSpec(tuple(shape), dtype)
            if not isinstance(spec.dtype, torch.dtype):
                raise ConfigError(f"field {name!r}: dtype must be a torch.dtype, got {spec.dtype!r}")
            self.specs[name] = FieldSpec(tuple(int(s) for s in spec.shape), spec.dtype)
        self._data = {
            name: torch.zeros((capacity, *spec.shape), dtype=spec.dtype, device=self.device)
            for name, spec in self.specs.items()
        }
        self._ptr = 0
        self._size = 0

    @property
    def size(self) -> int:
        """Number of items held (at most ``capacity``)."""
        return self._size

    @property
    def full(self) -> bool:
        """True once ``capacity`` items are held (further adds overwrite the oldest)."""
        return self._size == self.capacity

    def __len__(self) -> int:
        return self._size

    def add(self, **batch: Tensor) -> None:
        """Append a batch: one tensor [n, *shape] per field, all fields, same n, exact dtypes.

        Tensors on another device are moved to the buffer's device. If n > capacity only the
        last ``capacity`` items are kept.
        """
        missing = sorted(set(self.specs) - set(batch))
        unknown = sorted(set(batch) - set(self.specs))
        if missing or unknown:
            raise DataError(
                f"rollout buffer add: missing fields {missing}, unknown fields {unknown}; "
                f"expected exactly {sorted(self.specs)}"
            )
        n = None
        for name, value in batch.items():
            spec = self.specs[name]
            if not isinstance(value, Tensor):
                raise DataError(f"field {name!r}: expected a tensor, got {type(value).__name__}")
            if value.dtype != spec.dtype:
                raise DataError(f"field {name!r}: expected dtype {spec.dtype}, got {value.dtype}")
            if value.dim() != len(spec.shape) + 1 or tuple(value.shape[1:]) != spec.shape:
                expected = "[" + ", ".join(["n", *map(str, spec.shape)]) + "]"
                raise DataError(f"field {name!r}: expected shape {expected}, got {list(value.shape)}")
            if n is None:
                n = value.shape[0]
            elif value.shape[0] != n:
                raise DataError(f"field {name!r} has {value.shape[0]} items but other fields have {n}")
        if not n:
            return
        keep = min(n, self.capacity)
        skipped = n - keep
        idx = (torch.arange(keep, device=self.device) + (self._ptr + skipped)) % self.capacity
        for name, value in batch.items():
            self._data[name].index_copy_(0, idx, value[skipped:].to(self.device, non_blocking=True))
        self._ptr = (self._ptr + n) % self.capacity
        self._size = min(self._size + n, self.capacity)

    def _physical(self, indices: Tensor | Sequence[int]) -> Tensor:
        if not isinstance(indices, Tensor):
            indices = list(indices)
            bad = [i for i in indices if not -self._size <= i < self._size]
            if bad:
                raise DataError(f"buffer indices {bad[:5]} out of range for size {self._size}")
            indices = torch.tensor(indices, dtype=torch.int64)
        elif indices.is_floating_point() or indices.dim() != 1:
            raise DataError(
                f"indices must be a 1-D integer tensor, got {indices.dtype} {tuple(indices.shape)}"
            )
        start = (self._ptr - self._size) % self.capacity
        logical = indices.to(self.device, torch.int64) % max(self._size, 1)
        return (logical + start) % self.capacity

    def get(self, indices: Tensor | Sequence[int]) -> dict[str, Tensor]:
        """Copies of the items at logical positions ``indices`` (0 = oldest; negatives count from
        the newest). Python sequences are range-checked; device tensors are not (no host sync)."""
        if self._size == 0:
            raise DataError("rollout buffer is empty")
        phys = self._physical(indices)
        return {name: data.index_select(0, phys) for name, data in self._data.items()}

    def all(self) -> dict[str, Tensor]:
        """Copies of every held item, oldest first."""
        if self._size == 0:
            return {name: data[:0].clone() for name, data in self._data.items()}
        return self.get(torch.arange(self._size, device=self.device))

    def sample(
        self, batch_size: int, generator: torch.Generator | None = None, replacement: bool = False
    ) -> dict[str, Tensor]:
        """A random batch of items; reproducible for a seeded ``generator`` (indices are drawn on
        the generator's device, then moved)."""
        if self._size == 0:
            raise DataError("cannot sample from an empty rollout buffer")
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        if not replacement and batch_size > self._size:
            raise DataError(
                f"batch_size={batch_size} exceeds the {self._size} items held (sampling without replacement)"
            )
        gen_device = generator.device if generator is not None else self.device
        if replacement:
            idx = torch.randint(self._size, (batch_size,), generator=generator, device=gen_device)
        else:
            idx = torch.randperm(self._size, generator=generator, device=gen_device)[:batch_size]
        return self.get(idx)

    def clear(self) -> None:
        """Forget every item (storage is kept and reused)."""
        self._ptr = 0
        self._size = 0
