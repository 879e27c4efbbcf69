"""glibc malloc tuning for CPU runs: a fixed mmap threshold, so freed tensors go back to the OS.

PyTorch's CPU tensors come straight from ``malloc``. glibc serves a block of at least the *mmap
threshold* (128 KiB at start) with its own ``mmap`` and unmaps it on ``free``; but the first time
such a block is freed it raises the threshold to that block's size (up to 32 MiB) and the trim
threshold to twice that. From then on a training step's activations (a few MiB each) come from the
heap, and what they leave behind when freed stays resident: the heap only shrinks from its top,
and only past the trim threshold. A GRPO round -- rollouts, a reference forward, then a forward
and backward per micro-batch -- leaves the heap grown to its largest phase's live set plus the
fragmentation, and the process's RSS stays there.

Holding the threshold fixed (``mallopt(M_MMAP_THRESHOLD, ...)``, which also switches the
adaptation off) keeps every large tensor in its own mapping, returned on free, so RSS follows the
live tensors more closely. The value trades memory for page faults: each mapped block is faulted in
afresh. Measured on bench/bench_random_model.py (random-weight 25M-parameter Qwen2, 1 thread; see
docs/benchmarks.md): glibc's adaptive threshold 1.00-1.03 GiB peak RSS; 1 MiB 0.88 GiB at the same
CPU time per step; 128 KiB 0.81 GiB but ~35 % more CPU time (every decode step's MLP tensors, a
few hundred KiB each, are then mapped and unmapped); ``malloc_trim`` between phases instead: 0.99 GiB.
Hence 1 MiB. The setting is what ``MALLOC_MMAP_THRESHOLD_=1048576`` would give, applied at run
time, and only when the user has not chosen one (that variable, or ``glibc.malloc.mmap_threshold``
in ``GLIBC_TUNABLES``). Nothing happens on other C libraries (musl, macOS, Windows).
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

#: glibc's ``M_MMAP_THRESHOLD`` parameter number for ``mallopt`` (malloc.h).
M_MMAP_THRESHOLD = -3
#: The threshold set (held fixed instead of adapting upwards); see the module docstring for why 1 MiB.
MMAP_THRESHOLD_BYTES = 1024 * 1024
#: Environment variables through which a user sets the threshold (then it is left alone).
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_",)
_TUNABLE = "glibc.malloc.mmap_threshold"


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
    """Whether the environment already chooses glibc's mmap threshold."""
    if any(env.get(name) for name in USER_SETTINGS):
        return True
    return any(item.split("=", 1)[0].strip() == _TUNABLE
               for item in env.get("GLIBC_TUNABLES", "").split(":"))


def fix_mmap_threshold(env: Mapping[str, str] = os.environ, libc: Any | None = None) -> int | None:
    """Set glibc's mmap threshold to :data:`MMAP_THRESHOLD_BYTES` unless the user set one; return
    the bytes set, or None when nothing was set (not glibc, the user's own setting, mallopt refused).

    ``libc`` defaults to :func:`glibc` (tests pass a fake). Idempotent.
    """
    if user_set_threshold(env):
        return None
    libc = glibc() if libc is None else libc
    if libc is None:
        return None
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        logger.debug("mallopt(M_MMAP_THRESHOLD, %d) was refused", MMAP_THRESHOLD_BYTES)
        return None
    return MMAP_THRESHOLD_BYTES
