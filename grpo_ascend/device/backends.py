"""Which accelerator backends this process can use: the lazy, cached torch_npu import, and the
``torch.npu`` / ``torch.cuda`` namespace behind a device.

``torch_npu`` is imported inside functions, and only once: on a machine without the CANN
libraries importing it fails, and that must never break ``import grpo_ascend``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from grpo_ascend.errors import DeviceError

logger = logging.getLogger(__name__)

DEVICE_TYPES = ("auto", "cpu", "cuda", "npu")
ACCELERATOR_TYPES = ("npu", "cuda")

#: The command that loads the CANN toolkit's libraries into a shell.
CANN_SET_ENV_COMMAND = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"


@dataclass(frozen=True)
class NpuImport:
    """Outcome of importing torch_npu: the module, or whether it is missing or failed to load."""

    module: ModuleType | None
    installed: bool
    error: BaseException | None = None


@functools.lru_cache(maxsize=1)
def load_torch_npu() -> NpuImport:
    """Import torch_npu once and cache the outcome; never raises.

    A ``ModuleNotFoundError`` naming torch_npu means it is not installed; any other exception
    (typically OSError/ImportError from missing CANN shared libraries) means it is installed but
    could not load. Call :func:`forget_torch_npu` to retry.
    """
    try:
        module = importlib.import_module("torch_npu")
    except ModuleNotFoundError as exc:
        if exc.name == "torch_npu":
            return NpuImport(module=None, installed=False)
        return NpuImport(module=None, installed=True, error=exc)
    except Exception as exc:  # any failure inside torch_npu's import is reported
        return NpuImport(module=None, installed=True, error=exc)
    return NpuImport(module=module, installed=True)


@functools.lru_cache(maxsize=1)
def _warn_npu_import_failed(message: str) -> None:
    logger.warning("%s; falling back to another device", message)


def forget_torch_npu() -> None:
    """Forget the cached torch_npu import (and its one-time warning), so the next call imports again.

    For code (tests, a notebook) that installs or replaces torch_npu after the first attempt.
    """
    load_torch_npu.cache_clear()
    _warn_npu_import_failed.cache_clear()


def _npu_missing_message() -> str:
    base = torch.__version__.split("+", 1)[0]
    return (
        f"device 'npu' requested but torch_npu is not installed; install the Ascend adapter that "
        f"matches torch {base} with `pip install \"torch-npu=={base}.*\"` (or `pip install "
        f"'grpo-ascend[npu]'`) on a machine with the CANN toolkit, or choose --device auto/cuda/cpu"
    )


def _npu_import_failed_message(error: BaseException) -> str:
    return (
        f"torch_npu is installed but importing it failed ({type(error).__name__}: {error}); its CANN "
        f"libraries probably did not load: run `{CANN_SET_ENV_COMMAND}` (the set_env.sh of your CANN toolkit) "
        f"before starting Python. Note torch>=2.5 autoloads torch_npu at `import torch` when it is "
        f"installed; set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to disable that on machines without NPUs"
    )


def import_torch_npu() -> ModuleType:
    """Return the torch_npu module, or raise DeviceError saying why it is unusable."""
    result = load_torch_npu()
    if result.module is not None:
        return result.module
    if not result.installed:
        raise DeviceError(_npu_missing_message())
    assert result.error is not None
    raise DeviceError(_npu_import_failed_message(result.error))


def npu_available() -> bool:
    """True when torch_npu imports and reports at least one NPU (warns once on a broken install)."""
    result = load_torch_npu()
    if result.module is None:
        if result.installed and result.error is not None:
            _warn_npu_import_failed(_npu_import_failed_message(result.error))
        return False
    npu = getattr(torch, "npu", None)
    if npu is None:
        return False
    try:
        return bool(npu.is_available())
    except Exception:  # a driver error means "no usable NPU"
        return False


def cuda_available() -> bool:
    """True when torch sees a CUDA device."""
    return bool(torch.cuda.is_available())


def split_device(device: torch.device | str) -> tuple[str, int | None]:
    """(type, index) of a torch.device or a string like 'npu:0', without constructing a device."""
    if isinstance(device, str):
        text = device.strip().lower()
        kind, sep, index = text.partition(":")
        if not sep:
            return kind, None
        if not index.isdigit():
            raise DeviceError(
                f"invalid device {device!r}: the index after ':' must be a non-negative integer, "
                f"e.g. 'npu:0' or 'cuda:1'"
            )
        return kind, int(index)
    return str(device.type), device.index


def device_type(device: torch.device | str) -> str:
    """The device type ('cpu', 'cuda', 'npu', ...) of a torch.device or device string."""
    return split_device(device)[0]


def is_accelerator(device: torch.device | str) -> bool:
    """True for NPU and CUDA devices."""
    return device_type(device) in ACCELERATOR_TYPES


def backend_module(kind: str) -> Any:
    """torch.cuda or torch.npu (importing torch_npu first) for an accelerator type."""
    if kind == "cuda":
        return torch.cuda
    if kind == "npu":
        import_torch_npu()
        return torch.npu  # registered by torch_npu on import
    raise DeviceError(f"device type {kind!r} has no accelerator backend; expected one of {ACCELERATOR_TYPES}")


def device_index(device: torch.device | str) -> int:
    """The index of an accelerator device; its backend's current device when none is given."""
    kind, index = split_device(device)
    if index is not None:
        return index
    return int(backend_module(kind).current_device())
