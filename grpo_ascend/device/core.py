"""Which device a process runs on: detection, resolution of a requested device, and device counts.

Resolving an accelerator makes it current and, on Ascend, applies the runtime defaults
(:mod:`grpo_ascend.device.ascend`); resolving the CPU tunes glibc's allocator
(:mod:`grpo_ascend.device.host_allocator`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from grpo_ascend.device import host_allocator
from grpo_ascend.device.ascend import apply_npu_runtime_defaults
from grpo_ascend.device.backends import (
    DEVICE_TYPES,
    backend_module,
    cuda_available,
    device_type,
    import_torch_npu,
    npu_available,
    split_device,
)
from grpo_ascend.errors import DeviceError, closest

logger = logging.getLogger(__name__)


def detect_device_type() -> str:
    """Return 'npu' if torch_npu imports and sees an NPU, else 'cuda' if available, else 'cpu'."""
    if npu_available():
        return "npu"
    if cuda_available():
        return "cuda"
    return "cpu"


def local_rank_from_env(local_rank: int | None) -> int:
    """``local_rank`` when given, else the LOCAL_RANK env var (0 when unset); DeviceError if negative."""
    if local_rank is not None:
        if local_rank < 0:
            raise DeviceError(f"local_rank must be >= 0, got {local_rank}")
        return local_rank
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        value = int(raw)
    except ValueError:
        raise DeviceError(f"LOCAL_RANK={raw!r} is not an integer; unset it or set it to this process's local rank") from None
    if value < 0:
        raise DeviceError(f"LOCAL_RANK={raw!r} must be >= 0")
    return value


def resolve_device(requested: str = "auto", local_rank: int | None = None) -> torch.device:
    """Turn 'auto' / 'cpu' / 'cuda' / 'npu' / 'cuda:1' / 'npu:0' into a usable torch.device.

    Without an explicit index the local index is ``local_rank`` or the LOCAL_RANK env var (0);
    when exactly one device is visible (the launcher binds one per rank) that device is used.
    Accelerators are made current (set_device); on NPU the runtime defaults are applied first.
    Raises DeviceError naming the problem and the fix when the device is not usable.
    """
    if not isinstance(requested, str) or not requested.strip():
        raise DeviceError(f"device must be a string such as 'auto', 'cpu', 'cuda', 'npu' or 'npu:0', got {requested!r}")
    kind, index = split_device(requested)
    if kind not in DEVICE_TYPES:
        raise DeviceError(
            f"unknown device {requested!r}{closest(kind, DEVICE_TYPES)}; expected one of "
            f"{', '.join(DEVICE_TYPES)} (optionally with an index, e.g. 'npu:0')"
        )
    if kind == "auto":
        if index is not None:
            raise DeviceError(f"invalid device {requested!r}: 'auto' takes no index; use e.g. 'npu:1' instead")
        kind = detect_device_type()
    if kind == "cpu":
        tune_host_allocator("cpu")
        return torch.device("cpu")
    if kind == "npu":
        import_torch_npu()
        if not npu_available():
            visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "<unset>")
            raise DeviceError(
                f"device {requested!r} requested but torch_npu reports no NPU (torch.npu.is_available() is "
                f"False); check `npu-smi info`, the Ascend driver, and ASCEND_RT_VISIBLE_DEVICES={visible}"
            )
        applied = apply_npu_runtime_defaults()
        if applied:
            logger.info("applied Ascend runtime defaults: %s", applied)
    elif kind == "cuda" and not cuda_available():
        built = torch.version.cuda or "none (this is a CPU-only torch build)"
        raise DeviceError(
            f"device {requested!r} requested but CUDA is not available (torch {torch.__version__}, "
            f"CUDA runtime {built}); install a CUDA build of torch, check `nvidia-smi` and "
            f"CUDA_VISIBLE_DEVICES, or choose --device auto/cpu"
        )
    module = backend_module(kind)
    count = int(module.device_count())
    position = index if index is not None else local_rank_from_env(local_rank)
    if index is None and count == 1:
        position = 0  # the launcher bound one device to this process (per-rank visible devices)
    if position >= count:
        raise DeviceError(
            f"device index {position} for {kind!r} is out of range: {count} {kind} device(s) visible to "
            f"this process; use an index below {count} or fix the launcher's LOCAL_RANK / visible devices"
        )
    module.set_device(position)
    return torch.device(f"{kind}:{position}")


def tune_host_allocator(device: torch.device | str, env: Mapping[str, str] = os.environ,
                        tensor_bytes: int | None = None) -> int | None:
    """On the CPU, fix glibc's mmap threshold (unless the user set one) so freed tensors return to the OS.

    Otherwise glibc serves tensors from its heap, whose freed space stays resident: peak RSS 1.00-1.03 GiB
    instead of 0.88 GiB on bench/bench_random_model.py (see grpo_ascend/device/host_allocator.py).
    ``tensor_bytes``: the largest activation of a training micro-batch, which the threshold then keeps in the
    heap (a fresh mapping per such tensor is faulted in page by page); None keeps the size set before.
    Returns the threshold set, or None (another device, not glibc, or the user's own setting).
    Called by :func:`resolve_device` for the CPU and by the trainer once it knows its micro-batch.
    """
    if device_type(device) != "cpu":
        return None
    return host_allocator.fix_mmap_threshold(env, tensor_bytes=tensor_bytes)  # looked up per call: a benchmark may switch it off


def device_count(kind: str | None = None) -> int:
    """Number of devices of ``kind`` (default: the detected type) visible here; 1 for the CPU."""
    kind = kind or detect_device_type()
    if kind == "cpu":
        return 1
    if kind == "npu" and not npu_available():
        return 0
    if kind == "cuda" and not cuda_available():
        return 0
    return int(backend_module(kind).device_count())


def dist_backend(device: torch.device | str) -> str:
    """torch.distributed backend for a device: 'hccl' on NPU, 'nccl' on CUDA, 'gloo' otherwise."""
    return {"npu": "hccl", "cuda": "nccl"}.get(device_type(device), "gloo")
