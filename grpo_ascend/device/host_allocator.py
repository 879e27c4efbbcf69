"""glibc malloc tuning for CPU runs: a fixed mmap threshold, so freed tensors go back to the OS.

PyTorch's CPU tensors come straight from ``malloc``. glibc serves a block of at least the *mmap
threshold* (128 KiB at start) with its own ``mmap`` and unmaps it on ``free``; but the first time
such a block is freed it raises the threshold to that block's size (up to 32 MiB) and the trim
threshold to twice that. From then on a training step's activations (a few MiB each) come from the
heap, and what they leave behind when freed stays resident: the heap only shrinks from its top,
and only past the trim threshold. A GRPO round -- rollouts, a reference forward, then a forward
and backward per micro-batch -- leaves the heap grown to its largest phase's live set plus the
fragmentation, and the process's RSS stays there.

Holding the thresholds fixed (``mallopt``, which also switches the adaptation off) keeps every
large tensor in its own mapping, returned on free, so RSS follows the live tensors more closely.
The price is page faults: each mapped block is faulted in afresh, and so is heap the top trim gave
back. The values trade memory for those faults. Measured on bench/bench_random_model.py
(random-weight 25M Qwen2, 1 thread, quiet machine; peak RSS of the whole process, system time over
a 4-step run):

* glibc's adaptive thresholds: 1,065 MB;
* mmap 1 MiB (this module's first setting): 883-921 MB, but 4.6-7.0 s of system time against
  ~1 s, and a training phase 1.3-1.4x as long: every activation of a training micro-batch
  (1-3 MiB at 575 positions x 512-1,376 features) was a fresh mapping;
* mmap 4 MiB, trim 16 MiB (now): 1,018 MB, ~1 s of system time, the step as fast as with the
  adaptive thresholds. Tensors under 4 MiB are reused from the heap; the heap keeps at most
  16 MiB of free space at its top; larger blocks (full-vocabulary logits chunks, KV caches,
  real-size MLP activations) still go back to the OS on free. 8 MiB was as fast but, at
  Qwen2.5-0.5B's shapes (bench/bench_real_shape.py), peaked at 2.22 GiB against 1.95 GiB.

Those tensors were under 4 MiB at TRL's default micro-batches of 8. One micro-batch of 32 completions makes the
MLP's activations 11.5 MB (32 × 64 positions × 1,408 features in float32) and the attention probabilities 8 MB:
each a fresh mapping, faulted in page by page, every time. The element-wise passes over them then ran at 5 GB/s
and ``fill_`` at under 1 GB/s; the training phase took 2.5-2.8 s instead of 1.8-1.9 s (built-in ``small`` model,
2 threads). So a trainer sizes the threshold to its training micro-batch (:func:`threshold_for`): the power of two
at or above the largest activation a decoder layer makes, at least 4 MiB, and the trim threshold four times that.
At micro-batches of 8 this stays 4 MiB / 16 MiB. Activations past glibc's own 32 MiB ceiling are mapped whatever
the threshold, so there it stays 4 MiB / 16 MiB too: at Qwen2.5-0.5B's shapes (bench/bench_real_shape.py, micro-
batches of 8 x 256 tokens through a 4,864-wide MLP, 40 MB) a 32 MiB / 128 MiB setting peaked at 2,192 MiB against
2,015 MiB, with the same step time (62.0 vs 62.4 s).

The floor setting is what ``MALLOC_MMAP_THRESHOLD_=4194304 MALLOC_TRIM_THRESHOLD_=16777216`` would give,
applied at run time, and only when the user has chosen neither (those variables, or
``glibc.malloc.mmap_threshold`` / ``glibc.malloc.trim_threshold`` in ``GLIBC_TUNABLES``). Nothing
happens on other C libraries (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: glibc's ``M_TRIM_THRESHOLD`` and ``M_MMAP_THRESHOLD`` parameter numbers for ``mallopt`` (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: The smallest mmap threshold set (held fixed instead of adapting upwards); see the module docstring for why.
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024
#: The largest: glibc's own ceiling for its adaptive threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
MAX_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Free space the heap keeps at its top before giving it back, per byte of mmap threshold.
TRIM_PER_MMAP = 4
#: The trim threshold that goes with :data:`MMAP_THRESHOLD_BYTES`.
TRIM_THRESHOLD_BYTES = TRIM_PER_MMAP * MMAP_THRESHOLD_BYTES
#: Environment variables through which a user sets either threshold (then both are left alone).
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


@functools.lru_cache(maxsize=1)
def glibc() -> Any | None:
    """The process's C library when it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def user_set_threshold(env: Mapping[str, str]) -> bool:
    """Whether the environment already chooses glibc's mmap or trim threshold."""
    if any(env.get(name) for name in USER_SETTINGS):
        return True
    return any(item.split("=", 1)[0].strip() in _TUNABLES
               for item in env.get("GLIBC_TUNABLES", "").split(":"))


def threshold_for(tensor_bytes: int) -> int:
    """The mmap threshold that serves tensors of ``tensor_bytes`` from the heap: the power of two at or above it,
    at least :data:`MMAP_THRESHOLD_BYTES`. Past :data:`MAX_MMAP_THRESHOLD_BYTES` no threshold keeps them in the heap,
    so the floor stays: raising it would only keep more freed heap resident (see the module docstring)."""
    if tensor_bytes < 0:
        raise ValueError(f"tensor_bytes must be >= 0, got {tensor_bytes!r}")
    if tensor_bytes > MAX_MMAP_THRESHOLD_BYTES:
        return MMAP_THRESHOLD_BYTES
    wanted = 1 << max(int(tensor_bytes) - 1, 0).bit_length()
    return max(wanted, MMAP_THRESHOLD_BYTES)


#: The mmap threshold this module last set (None: none yet); only :func:`fix_mmap_threshold` writes it.
_current: int | None = None


def fix_mmap_threshold(env: Mapping[str, str] = os.environ, libc: Any | None = None,
                       tensor_bytes: int | None = None) -> int | None:
    """Set glibc's mmap threshold (:func:`threshold_for` ``tensor_bytes``) and trim threshold (:data:`TRIM_PER_MMAP`
    times it) unless the user set one; return the mmap threshold set, or None when nothing was set (not glibc,
    the user's own setting, mallopt refused).

    ``tensor_bytes``: the largest activation a training micro-batch makes, which should come from the heap;
    None keeps what an earlier call sized (else the floor). ``libc`` defaults to :func:`glibc` (tests pass a
    fake). Idempotent.
    """
    global _current
    if user_set_threshold(env):
        return None
    libc = glibc() if libc is None else libc
    if libc is None:
        return None
    if tensor_bytes is not None:
        threshold = threshold_for(tensor_bytes)
    else:
        threshold = _current or MMAP_THRESHOLD_BYTES
    if libc.mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        logger.debug("mallopt(M_MMAP_THRESHOLD, %d) was refused", threshold)
        return None
    if libc.mallopt(M_TRIM_THRESHOLD, TRIM_PER_MMAP * threshold) != 1:
        logger.debug("mallopt(M_TRIM_THRESHOLD, %d) was refused", TRIM_PER_MMAP * threshold)
    _current = threshold
    return threshold
