"""Policy versions handed from the trainer to a rollout process in shared memory, never through files.

A :class:`WeightRing` holds two slots of the tensors a sync replaces (LoRA: the adapted layers'
merged weights; full fine-tuning: every parameter), each in shared memory with its own lock and
version. The trainer writes version ``v`` into slot ``v % 2`` while the sampler may read the
other, so a sampler pinned to the previous version (``one_step_off``) still finds it, and a reader
never sees a half-written slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.multiprocessing
from torch import Tensor, nn

from grpo_ascend.errors import RolloutError

SLOTS = 2


class VersionEvicted(RolloutError):
    """A version asked for is no longer in the ring: two newer ones were written since."""


class WeightRing:
    """Two shared-memory slots of named tensors (see the module docstring); made by the trainer, then
    handed to the rollout process when it starts (the tensors travel as shared-memory handles)."""

    def __init__(self, tensors: Mapping[str, Tensor], context: Any) -> None:
        self.slots = [{name: torch.empty(t.shape, dtype=t.dtype).share_memory_() for name, t in tensors.items()}
                      for _ in range(SLOTS)]
        self.locks = [context.Lock() for _ in range(SLOTS)]
        self.versions = context.Array("q", [-1] * SLOTS)
        self.latest = context.Value("q", -1)
        self._pushes = 0  # the trainer's count of writes: the next write's slot (the trainer's copy only)

    @property
    def names(self) -> list[str]:
        return list(self.slots[0])

    def write(self, version: int, tensors: Iterable[tuple[str, Tensor]], timeout: float) -> None:
        """Put ``version``'s tensors into the slot after the last written; waits at most ``timeout`` s for a
        reader to finish there."""
        slot = self._pushes % SLOTS
        self._pushes += 1
        if not self.locks[slot].acquire(timeout=timeout):
            raise RolloutError(f"weight sync of version {version} waited more than weight_sync_timeout={timeout:g} s for "
                               "the rollout process to finish reading; it is stuck. Raise weight_sync_timeout if its "
                               "reads are legitimately that slow")
        try:
            self.versions[slot] = -1
            target = self.slots[slot]
            seen = 0
            for name, tensor in tensors:
                target[name].copy_(tensor.detach())
                seen += 1
            if seen != len(target):
                raise RolloutError(f"weight sync of version {version} gave {seen} tensors, the ring holds {len(target)}")
            self.versions[slot] = version
        finally:
            self.locks[slot].release()
        with self.latest.get_lock():
            self.latest.value = max(self.latest.value, version)

    def read_into(self, params: Mapping[str, Tensor], version: int | None, timeout: float) -> int:
        """Copy ``version`` (None: the newest) into ``params`` (the sampler's tensors); returns the version read."""
        wanted = self.latest.value if version is None else version
        slots = [k for k in range(SLOTS) if self.versions[k] == wanted]
        slot = slots[0] if slots else 0
        if not self.locks[slot].acquire(timeout=timeout):
            raise RolloutError(f"reading weights version {wanted} waited more than {timeout:g} s for the trainer's write")
        try:
            if self.versions[slot] != wanted:
                raise VersionEvicted(f"weights version {wanted} is no longer in the ring (slot holds "
                                   f"{self.versions[slot]}); a pinned sampler fell {SLOTS} versions behind")
            with torch.no_grad():
                for name, tensor in self.slots[slot].items():
                    params[name].copy_(tensor)
        finally:
            self.locks[slot].release()
        return wanted


def named_tensors(model: nn.Module, names: Iterable[str]) -> dict[str, Tensor]:
    """The tensors named ``names`` in ``model``'s state dict, by reference (the sampler's side of a sync)."""
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    missing = [n for n in names if n not in state]
    if missing:
        raise RolloutError(f"the rollout process's model has no tensors {missing[:3]}; the policy and its copy differ")
    return {n: state[n] for n in names}


def spawn_context(*preload: str) -> Any:
    """The process context rollout processes start in: forked from a fork server, a fresh interpreter that has
    imported torch, the worker and ``preload`` (the model's and tokenizer's modules) once, never a fork of the
    trainer and its threads; a restart, or a later run's process, then starts without importing them again."""
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "grpo_ascend.rollout.process.worker", *preload])
    return context
