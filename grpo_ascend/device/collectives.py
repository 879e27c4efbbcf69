"""Process groups of their own, outside ``torch.distributed``'s default group: HCCL on an NPU, NCCL on a GPU,
gloo on the CPU.

A weight transfer joins the trainer's sending rank and a sampler's receiving ranks (a vLLM server's
workers, the rollout process) in a group that must not touch the training ranks' default group, nor the
sampler's own: each side builds it from a ``TCPStore`` the sender hosts, the way vLLM's stateless groups
and vllm-ascend's PyHcclCommunicator do. Only this module names the collective backends.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from grpo_ascend.device.backends import device_type, load_torch_npu
from grpo_ascend.errors import DeviceError


def _gloo(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _nccl(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _hccl(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    npu = load_torch_npu()
    if npu.module is None:
        raise DeviceError("a weight-transfer group on an NPU needs torch_npu (HCCL); install it with its CANN toolkit")
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore[import-not-found]

    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    return ProcessGroupHCCL(store, rank, world_size, options)


#: The collective backend of a transfer group, by the device type its buffers live on.
GROUP_BACKENDS = {"cpu": ("gloo", _gloo), "cuda": ("nccl", _nccl), "npu": ("hccl", _hccl)}


def transfer_backend(device: torch.device | str) -> str:
    """The collective backend a transfer group on ``device`` uses ('hccl', 'nccl' or 'gloo')."""
    return GROUP_BACKENDS.get(device_type(device), GROUP_BACKENDS["cpu"])[0]


def stateless_group(store: Any, rank: int, world_size: int, device: torch.device | str, timeout_s: float) -> Any:
    """A process group of ``world_size`` ranks over ``store`` for buffers on ``device``, independent of the default
    group; its collectives fail after ``timeout_s`` seconds instead of waiting for ever."""
    _, build = GROUP_BACKENDS.get(device_type(device), GROUP_BACKENDS["cpu"])
    return build(store, rank, world_size, datetime.timedelta(seconds=float(timeout_s)))


def broadcast(group: Any, tensor: torch.Tensor, root: int = 0) -> Any:
    """Start broadcasting ``tensor`` from ``root`` over ``group``; returns the work handle (``.wait()``)."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    return group.broadcast([tensor], options)
