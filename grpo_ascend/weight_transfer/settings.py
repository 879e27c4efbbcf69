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
    return bucket_bytes_for(free or 0, largest_tensor)


def bucket_bytes_for(free_bytes: int, largest_tensor: int = 0) -> int:
    """:func:`default_bucket_bytes` for a device with ``free_bytes`` free (0: unknown, the smallest default)."""
    share = int(free_bytes * FREE_MEMORY_SHARE) if free_bytes else MIN_BUCKET_BYTES
    return max(min(max(share, MIN_BUCKET_BYTES), MAX_BUCKET_BYTES), int(largest_tensor))


def _same_device(a: str, b: str) -> bool:
    """Whether two device strings name one device ('x' and 'x:0' do); read as text, so a device type whose torch
    extension is not loaded here (a plan made on another machine) still compares."""
    kind_a, _, index_a = a.partition(":")
    kind_b, _, index_b = b.partition(":")
    return kind_a == kind_b and int(index_a or 0) == int(index_b or 0)


def rollout_process_transfer(mode: str, trainer_device: torch.device | str,
                             rollout_device: torch.device | str) -> tuple[str, str]:
    """How policy versions reach the built-in rollout process: ``"collective"`` (a transfer group, device to
    device) or ``"ring"`` (two slots in host shared memory), and why, in one line for the log.

    ``auto``: collective when the process samples on another accelerator than the trainer's, else the ring (one
    host's memory holds both ends: a copy through shared memory is the cheapest hop). ``files`` is refused: the
    process never read its versions from files."""
    check_weight_transfer(mode, None)
    if mode == "files":
        raise ConfigError("weight_transfer='files' does not apply to the built-in rollout process (its versions go "
                          "through shared memory or a transfer group, never files); set weight_transfer: auto or "
                          "collective")
    trainer, rollout = str(trainer_device), str(rollout_device)
    same_kind = dev.transfer_backend(trainer) == dev.transfer_backend(rollout)
    if mode == "collective" and not same_kind:
        raise ConfigError(f"weight_transfer='collective' needs the trainer ({trainer}) and the rollout process "
                          f"({rollout}) on one kind of device (one collective backend joins them); set rollout_device "
                          "to a device of the trainer's kind, or weight_transfer: auto")
    if mode == "collective":
        return "collective", (f"weight_transfer=collective: versions go to the rollout process on {rollout} over a "
                              f"{dev.transfer_backend(rollout)} transfer group")
    if dev.is_accelerator(rollout) and same_kind and not _same_device(trainer, rollout):
        return "collective", (f"weight_transfer=auto: the rollout process samples on {rollout}, another accelerator "
                              f"than the trainer's {trainer}: versions go device to device over a "
                              f"{dev.transfer_backend(rollout)} transfer group")
    where = "the trainer's device" if _same_device(trainer, rollout) else "the trainer's host memory"
    return "ring", (f"weight_transfer=auto: the rollout process on {rollout} shares {where}: versions go through the "
                    "two-slot shared-memory ring (a transfer group pays off between two accelerators)")
