"""A scoped, fixed torch seed: building a model never disturbs the caller's random state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Fork the CPU torch RNG, seed it with ``seed`` for the block, and restore the caller's state after."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
