"""Mixed precision: bf16 support per device, the autocast context, and accelerate's setting."""

from __future__ import annotations

import contextlib

import torch

from grpo_ascend.device.backends import (
    ACCELERATOR_TYPES,
    cuda_available,
    device_type,
    is_accelerator,
    npu_available,
)
from grpo_ascend.errors import ConfigError, closest

_PRECISION_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "no": "fp32",
}
_TORCH_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _precision(dtype: str | torch.dtype | None) -> str:
    if dtype is None:
        return "fp32"
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES:
            raise ConfigError(f"unsupported mixed-precision dtype {dtype}; expected bf16, fp16 or fp32")
        return _TORCH_DTYPES[dtype]
    key = str(dtype).strip().lower()
    if key not in _PRECISION_ALIASES:
        raise ConfigError(
            f"unknown mixed-precision dtype {dtype!r}{closest(key, _PRECISION_ALIASES)}; expected 'bf16', 'fp16' or 'fp32'"
        )
    return _PRECISION_ALIASES[key]


def bf16_supported(device: torch.device | str) -> bool:
    """Whether bfloat16 compute is supported (always True on the CPU, where autocast supports it)."""
    kind = device_type(device)
    if kind == "cuda":
        return cuda_available() and bool(torch.cuda.is_bf16_supported())
    if kind == "npu":
        return npu_available() and bool(torch.npu.is_bf16_supported())
    return True


def autocast(device: torch.device | str, dtype: str | torch.dtype | None) -> contextlib.AbstractContextManager:
    """Mixed-precision context for forward passes: nullcontext for fp32, torch.autocast otherwise.

    fp16 on the CPU raises ConfigError instead of silently switching to bf16: fp16 needs a loss
    scaler and is slow on CPUs, and changing numerics without being asked would hide the problem.
    bf16 on a device without bf16 support (e.g. Ascend 910A, pre-Ampere GPUs) raises too.
    """
    precision = _precision(dtype)
    if precision == "fp32":
        return contextlib.nullcontext()
    kind = device_type(device)
    if precision == "fp16" and kind not in ACCELERATOR_TYPES:
        raise ConfigError(
            f"fp16 mixed precision is not supported on device {str(device)!r}; use bf16 (bf16: true) "
            f"or fp32 on the CPU, or run on an NPU/GPU"
        )
    if precision == "bf16" and not bf16_supported(device):
        raise ConfigError(
            f"bf16 is not supported on device {str(device)!r}; set bf16: false and fp16: true, or use fp32"
        )
    torch_dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=kind, dtype=torch_dtype)


def run_precision(device: torch.device | str, bf16: bool | None, fp16: bool) -> str:
    """'bf16', 'fp16' or 'fp32' for a run's ``bf16`` / ``fp16`` settings on ``device``: ``bf16`` None means bf16
    on an accelerator that supports it."""
    if bf16 is None:
        bf16 = is_accelerator(device) and bf16_supported(device)
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def mixed_precision_for_accelerate(bf16: bool, fp16: bool) -> str:
    """accelerate's ``mixed_precision`` value for the bf16/fp16 config switches."""
    if bf16 and fp16:
        raise ConfigError("bf16 and fp16 are both true; enable at most one of them")
    if bf16:
        return "bf16"
    if fp16:
        return "fp16"
    return "no"
