"""Policy versions received by a rollout process over a transfer group, straight into its model's tensors.

The collective counterpart of :class:`~grpo_ascend.rollout.process.weight_ring.WeightRing` for a rollout process on
an accelerator of its own: the trainer broadcasts each version in buckets (:mod:`grpo_ascend.weight_transfer`) and
the process copies every bucket's tensors into its model's tensors on its device, device to device. The version
before it stays on the device beside the model (the ring's second slot, here), so a request pinned to it
(``one_step_off``) swaps it in and back; an older version is gone (:class:`VersionEvicted`), as in the ring. It
offers the reads the worker makes of a ring (``latest.value``, ``names``, ``read_into``) plus :meth:`receive`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.rollout.process.weight_ring import VersionEvicted
from grpo_ascend.weight_transfer.group import GroupAddress, TransferGroup
from grpo_ascend.weight_transfer.manifest import Manifest
from grpo_ascend.weight_transfer.receiver import WeightReceiver


@dataclass
class _Latest:
    """The newest version received (``.value``, as a ring's shared value reads)."""

    value: int


class DeviceVersions:
    """The versions a rollout process holds on its device (see the module docstring)."""

    def __init__(self, initial_version: int, device: torch.device) -> None:
        self.device = device
        self.latest = _Latest(int(initial_version))
        self.names: list[str] = []
        self.live = int(initial_version)  # the version in the model's tensors
        self.previous: dict[str, Tensor] = {}  # the other version held, on the device
        self.previous_version = -1
        self.group: TransferGroup | None = None
        self._receiver: WeightReceiver | None = None

    def connect(self, address: dict[str, Any], timeout_s: float) -> None:
        """Join the trainer's group at ``address`` as rank 1 (once per process: the trainer builds it once)."""
        self.close()
        self.group = TransferGroup.join(GroupAddress.from_json(address), 1, self.device, timeout_s)
        self._receiver = WeightReceiver(self.group)

    def receive(self, params: Mapping[str, Tensor], version: int, manifest: Manifest) -> int:
        """Receive ``version`` into ``params`` (the model's tensors by name); the newest version before it is kept
        for pinned requests. A failure midway leaves the model unusable (the trainer then stops the process)."""
        if self._receiver is None:
            raise RuntimeError("a weight push arrived before the rollout process joined a transfer group")
        if self.live != self.latest.value:
            self._swap(params)  # the newest back in place: it becomes the previous version
        self.names = [spec.name for spec in manifest.tensors]
        with torch.no_grad():
            for name in self.names:
                held = self.previous.get(name)
                if held is None:
                    held = self.previous[name] = torch.empty_like(params[name])
                held.copy_(params[name])
            self.previous_version, self.live = self.live, -1
            for bucket in self._receiver.buckets(manifest):
                for name, view in bucket:
                    params[name].copy_(view)
        self.live = self.latest.value = int(version)
        return self.live

    def read_into(self, params: Mapping[str, Tensor], version: int | None, timeout: float) -> int:
        """Make ``version`` (None: the newest) the one in ``params``; returns it (``timeout``: unused, a ring's)."""
        wanted = self.latest.value if version is None else int(version)
        if wanted == self.live:
            return wanted
        if wanted != self.previous_version or wanted < 0:
            raise VersionEvicted(f"weights version {wanted} is no longer on the rollout device (it holds {self.live} "
                                 f"and {self.previous_version}); a pinned sampler fell 2 versions behind")
        self._swap(params)
        return wanted

    def _swap(self, params: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for name, held in self.previous.items():
                live = params[name].clone()
                params[name].copy_(held)
                held.copy_(live)
        self.live, self.previous_version = self.previous_version, self.live

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self._receiver = None, None
