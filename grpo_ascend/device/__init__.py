"""The device layer: the only package that names a device type or collective backend.

Everything else in grpo_ascend asks this package which device to use, how to autocast, how to
measure memory and how to seed, so the same code runs on Ascend NPUs, CUDA GPUs and the CPU.

Modules, one job each:

- ``backends``: the lazy, cached torch_npu import; the torch.npu / torch.cuda namespace of a device.
- ``core``: detecting and resolving the device, device counts, the collective backend.
- ``collectives``: process groups of their own (a weight transfer's), HCCL / NCCL / gloo by device.
- ``defaults``: settings chosen per device type (length buckets, decode layout and compilation, ...).
- ``calibration``: start-up measurements choosing between equivalent layouts on the CPU at hand.
- ``memory``: synchronising, allocator statistics, free memory (the process and host RAM on the CPU).
- ``precision``: bf16 support, autocast, accelerate's mixed-precision value.
- ``rng``: seeding, and RNG states for checkpoints.
- ``ascend``: Ascend runtime environment defaults, CANN version, chip family, HCCL timeouts.
- ``host_allocator``: glibc's malloc thresholds on CPU runs.
- ``npu_patches``: optional fused Ascend kernels, per model instance and chip.
- ``placement``: where a rollout process samples beside the trainer (device, CPU threads).
- ``doctor_facts`` / ``doctor``: what ``grpo-ascend doctor`` reports, and the command itself.

The public names below are re-exported here and load on first use, so importing the package
(as ``grpo-ascend doctor`` does when ``import torch`` itself is broken) imports neither torch
nor torch_npu. Code outside the package calls them through this package
(``from grpo_ascend import device as dev; dev.memory_stats(...)``); that makes this namespace the
one seam for tests: ``monkeypatch.setattr(grpo_ascend.device, name, fake)`` is seen by every
caller outside the package. A fake accelerator runtime (the torch_npu module, torch.npu) goes
in through ``sys.modules`` / ``torch`` followed by :func:`forget_torch_npu` (tests/support/fake_device.py).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    "backends": (
        "ACCELERATOR_TYPES", "DEVICE_TYPES", "NpuImport", "device_type", "forget_torch_npu", "import_torch_npu",
        "is_accelerator", "load_torch_npu",
    ),
    "collectives": ("GROUP_BACKENDS", "broadcast", "stateless_group", "transfer_backend"),
    "core": ("detect_device_type", "device_count", "dist_backend", "resolve_device", "tune_host_allocator"),
    "defaults": (
        "compile_for_decode", "decode_weights_transposed", "default_compile_decode", "default_length_bucket",
        "default_shared_prefix_decode", "float64_supported", "grouped_attention_max_bytes",
    ),
    "memory": ("empty_cache", "free_memory", "memory_stats", "reset_peak_memory", "synchronize"),
    "precision": ("autocast", "bf16_supported", "mixed_precision_for_accelerate", "run_precision"),
    "rng": ("rng_state", "seed_everything", "set_rng_state"),
    "ascend": (
        "CHIP_FAMILIES", "CHIP_FAMILY_NAMES", "HCCL_EXEC_AIV_CAP_S", "HCCL_EXEC_MARGIN_S", "HCCL_EXEC_STEP_S",
        "HCCL_WATCHDOG_DEFAULT_S", "NPU_RUNTIME_DEFAULTS", "CollectiveTimeouts", "apply_collective_timeouts",
        "apply_npu_runtime_defaults", "cann_version", "chip_family", "collective_timeouts", "derived_exec_timeout",
        "effective_exec_timeout", "soc_name",
    ),
    "npu_patches": ("apply_npu_patches",),
    "placement": ("RolloutPlacement", "host_threads", "rollout_placement", "use_trainer_threads"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups (and a test's monkeypatch) use the module dict directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
