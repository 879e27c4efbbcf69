"""Our attention implementations as transformers ones: registration, a scoped switch of a model to one, and
whether a model recomputes activations (our kernels step aside then).

Registration happens on first use: importing ``AttentionInterface`` loads ``modeling_utils``, which
probes the installed accelerator extensions.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any


@functools.cache
def register(name: str, forward: Callable[..., Any], masks_like: str | None = None) -> None:
    """Make ``forward`` the transformers attention implementation ``name``; ``masks_like``: build its
    masks as for that implementation (else transformers builds none)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(name, forward)
    if masks_like is not None:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[masks_like])


@contextlib.contextmanager
def attention_implementation(config: Any, name: str) -> Iterator[None]:
    """Inside the block every attention layer reading ``config`` runs implementation ``name``; restored on exit."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def activation_checkpointing_on(model: Any) -> bool:
    """Whether a transformers model recomputes activations in backward (the name changed in v5)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False
