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


_host_threads: list[int] = []  # the process's thread count before the first split (its only writer: this module)


def host_threads() -> int:
    """The CPU threads this process had before any rollout split took part of them."""
    return _host_threads[0] if _host_threads else torch.get_num_threads()


def rollout_placement(trainer_device: torch.device, device: str | None, threads: int | None) -> RolloutPlacement:
    """Sensible defaults, each overridable: on the CPU, the process's threads (:func:`host_threads`, so a
    second run in one process splits the same number) in two halves (the sampler gets ``threads`` when
    given, the trainer the rest, at least one each); on an accelerator, the requested device (``npu:1``,
    ...) or else the trainer's own, with the CPU threads left alone."""
    if not is_accelerator(trainer_device) and (device is None or not is_accelerator(device)):
        total = host_threads()
        mine = threads if threads is not None else max(1, total // 2)
        return RolloutPlacement("cpu", mine, max(1, total - mine))
    return RolloutPlacement(device if device is not None else str(trainer_device), threads, None)


def use_trainer_threads(place: RolloutPlacement | None) -> None:
    """Give the trainer the threads ``place`` leaves it, or (``None``: no rollout process) all of
    :func:`host_threads` back."""
    if place is not None and place.trainer_threads is not None:
        if not _host_threads:
            _host_threads.append(torch.get_num_threads())
        torch.set_num_threads(place.trainer_threads)
    elif _host_threads:
        torch.set_num_threads(_host_threads.pop())
