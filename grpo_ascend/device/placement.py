"""Where a rollout process samples beside the trainer: its device, and on the CPU how the cores are split."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_ascend.device.backends import is_accelerator


@dataclass(frozen=True)
class RolloutPlacement:
    """The rollout process's device and CPU threads, and the threads the trainer keeps (None: unchanged)."""

    device: str
    threads: int | None
    trainer_threads: int | None


def rollout_placement(trainer_device: torch.device, device: str | None, threads: int | None) -> RolloutPlacement:
    """Sensible defaults, each overridable: on the CPU, the trainer's threads split in two halves (the
    sampler gets ``threads`` when given, the trainer the rest, at least one each); on an accelerator,
    the requested device (``npu:1``, ...) or else the trainer's own, with the CPU threads left alone."""
    if not is_accelerator(trainer_device) and (device is None or not is_accelerator(device)):
        total = torch.get_num_threads()
        mine = threads if threads is not None else max(1, total // 2)
        return RolloutPlacement("cpu", mine, max(1, total - mine))
    return RolloutPlacement(device if device is not None else str(trainer_device), threads, None)
