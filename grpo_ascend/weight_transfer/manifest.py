"""What a transfer sends: each tensor's name, dtype and shape, laid out in buckets of flat bytes.

Both ends derive the same layout from the same :class:`Manifest` (it travels as JSON), so a bucket is one
broadcast of one flat buffer and its tensors are views into it: bit for bit what was sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_ascend.errors import ConfigError

#: Byte alignment of every tensor inside a bucket (any dtype's view of the buffer is then aligned).
ALIGN = 64


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ('float32', 'bfloat16', ...)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown tensor dtype {name!r} in a weight-transfer manifest")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a transfer: its name, its dtype on the wire, its full (unsharded) shape, its byte offset."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= int(d)
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor inside ``buffer`` (a flat uint8 bucket), as a view."""
        return buffer[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class Bucket:
    """Tensors sent in one broadcast, packed at aligned offsets into ``nbytes`` bytes."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Manifest:
    """Every tensor of one transfer, in sending order, cut into buckets of at most ``bucket_bytes``."""

    buckets: tuple[Bucket, ...]
    bucket_bytes: int

    @classmethod
    def plan(cls, specs: Iterable[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int,
             setting: str = "weight_transfer_bucket_bytes") -> Manifest:
        """Cut ``(name, wire dtype, shape)`` triples, in order, into buckets; a tensor larger than ``bucket_bytes``
        is refused with the size that would fit (``setting``: the name the user set it by)."""
        bucket_bytes = int(bucket_bytes)
        buckets: list[Bucket] = []
        current: list[TensorSpec] = []
        used = 0
        for name, dtype, shape in specs:
            spec = TensorSpec(str(name), dtype, tuple(int(d) for d in shape))
            if spec.nbytes > bucket_bytes:
                raise ConfigError(
                    f"{setting}={bucket_bytes} is smaller than the tensor {spec.name!r} ({spec.nbytes} bytes, "
                    f"{_dtype_name(dtype)} {list(spec.shape)}); set it to at least {_aligned(spec.nbytes)}, or null "
                    "(sized from free device memory)")
            if current and _aligned(used) + spec.nbytes > bucket_bytes:
                buckets.append(Bucket(tuple(current), used))
                current, used = [], 0
            start = _aligned(used)
            current.append(TensorSpec(spec.name, spec.dtype, spec.shape, start))
            used = start + spec.nbytes
        if current:
            buckets.append(Bucket(tuple(current), used))
        return cls(tuple(buckets), bucket_bytes)

    @property
    def tensors(self) -> list[TensorSpec]:
        return [t for b in self.buckets for t in b.tensors]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (tensor bytes, alignment padding inside buckets included)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def largest_bucket(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON-ready data (what travels to a receiver)."""
        return {"bucket_bytes": self.bucket_bytes,
                "buckets": [[[t.name, _dtype_name(t.dtype), list(t.shape), t.offset] for t in b.tensors]
                            + [b.nbytes] for b in self.buckets]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        """The manifest :meth:`to_json` made."""
        buckets = []
        for raw in data["buckets"]:
            *tensors, nbytes = raw
            buckets.append(Bucket(tuple(TensorSpec(n, dtype_of(d), tuple(s), int(o)) for n, d, s, o in tensors),
                                  int(nbytes)))
        return cls(tuple(buckets), int(data["bucket_bytes"]))
