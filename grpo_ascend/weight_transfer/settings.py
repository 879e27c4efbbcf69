"""``weight_transfer`` and the transfer bucket's size, checked with one clear line each."""

from __future__ import annotations

import torch

from grpo_ascend import device as dev
from grpo_ascend.errors import ConfigError, closest

#: auto: a process group where the sampler can join one, else files (said in one line); collective: a process
#: group or a clear error; files: write the weights for the sampler to read (a shared filesystem).
WEIGHT_TRANSFER_MODES = ("auto", "collective", "files")
#: A default bucket takes this share of the free device memory (two are in flight on each side) ...
FREE_MEMORY_SHARE = 0.02
#: ... within these bounds.
MIN_BUCKET_BYTES = 64 * 2**20
MAX_BUCKET_BYTES = 1024 * 2**20


def check_weight_transfer(mode: str, bucket_bytes: int | None) -> None:
    """``weight_transfer`` must be a known mode, the bucket null or a positive byte count."""
    if mode not in WEIGHT_TRANSFER_MODES:
        raise ConfigError(f"weight_transfer must be one of {list(WEIGHT_TRANSFER_MODES)}, got {mode!r}"
                          f"{closest(str(mode), WEIGHT_TRANSFER_MODES)}")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes < 1):
        raise ConfigError(f"weight_transfer_bucket_bytes must be null (sized from free device memory) or a positive "
                          f"number of bytes, got {bucket_bytes!r}")


def default_bucket_bytes(device: torch.device | str, largest_tensor: int = 0) -> int:
    """The bucket a transfer uses when none is set: a small share of ``device``'s free memory, within
    [MIN_BUCKET_BYTES, MAX_BUCKET_BYTES], and never smaller than the largest tensor sent."""
    free, _ = dev.free_memory(device)
    share = int(free * FREE_MEMORY_SHARE) if free else MIN_BUCKET_BYTES
    return max(min(max(share, MIN_BUCKET_BYTES), MAX_BUCKET_BYTES), int(largest_tensor))
