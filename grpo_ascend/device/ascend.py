"""The Ascend runtime: environment defaults, the CANN version, the chip family, and HCCL's timeouts.

``ddp_timeout`` is the one timeout setting: HCCL_EXEC_TIMEOUT is derived from it so that HCCL
reports a stuck collective before torch_npu's watchdog tears the process group down.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from grpo_ascend.device.backends import device_index, device_type, load_torch_npu, npu_available
from grpo_ascend.errors import ConfigError

logger = logging.getLogger(__name__)

#: Runtime defaults applied on Ascend when the user has not set them (see apply_npu_runtime_defaults).
#: HCCL_EXEC_TIMEOUT is not among them: it is derived from ``ddp_timeout`` (see collective_timeouts).
NPU_RUNTIME_DEFAULTS: dict[str, str] = {
    # Socket link set-up between ranks; default 120 s is too short when ranks load a model at
    # different speeds. Valid range [120, 7200] s.
    "HCCL_CONNECT_TIMEOUT": "1200",
    # Lets the caching allocator grow segments instead of fragmenting under variable rollout lengths.
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
}


def apply_npu_runtime_defaults(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set HCCL timeouts and PYTORCH_NPU_ALLOC_CONF where unset; return what was set.

    Call only on NPU, before the first NPU allocation and before HCCL initialises. Values the user
    exported are never overwritten.
    """
    applied: dict[str, str] = {}
    for name, value in NPU_RUNTIME_DEFAULTS.items():
        if not env.get(name):
            env[name] = value
            applied[name] = value
    return applied


#: What torch_npu puts in ``torch.version.cann`` when it finds no CANN install info (every release to 2.14).
CANN_UNKNOWN = "not known"


def cann_version() -> str | None:
    """CANN toolkit version reported by torch_npu, or None if unknown or torch_npu is unusable.

    torch_npu sets ``torch.version.cann`` at import from $ASCEND_HOME_PATH's install info ("not known"
    without it); ``get_cann_version(module="CANN")`` (torch_npu.utils, torch_npu.npu.utils) asks the runtime.
    """
    module = load_torch_npu().module
    if module is None:
        return None
    version = getattr(torch.version, "cann", None)
    if version and str(version).strip().lower() != CANN_UNKNOWN:
        return str(version)
    for owner in ("utils", "npu.utils"):
        target: Any = module
        for part in owner.split("."):
            target = getattr(target, part, None)
        getter = getattr(target, "get_cann_version", None)
        if getter is None:
            continue
        try:
            found = getter(module="CANN")
        except Exception:  # old CANN versions raise or return ''
            continue
        if found and str(found).strip().lower() != CANN_UNKNOWN:
            return str(found)
    return None


# --------------------------------------------------------------------------------------------
# Ascend chips: the SoC name torch_npu reports, and its product family
# --------------------------------------------------------------------------------------------

#: Product family of each SoC name that ``torch.npu.get_device_name()`` returns (torch_npu reads it
#: with aclrtGetSocName; the names are those of torch_npu's NpuVariables.cpp). Checked in order.
CHIP_FAMILIES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Ascend910(PremiumA|ProA|A|ProB|B)"), "training"),  # Atlas training series (910A/910 Pro)
    (re.compile(r"Ascend910B\d.*"), "A2"),  # Atlas A2 training/inference series (910B1..910B4-1)
    (re.compile(r"Ascend910_93\d\d"), "A3"),  # Atlas A3 training/inference series
    (re.compile(r"Ascend310P\d"), "inference"),  # Atlas inference series (300I Duo, ...)
    (re.compile(r"Ascend310B\d"), "200I/500 A2"),  # Atlas 200I/500 A2 inference products
)

CHIP_FAMILY_NAMES = {
    "training": "Atlas training series",
    "A2": "Atlas A2 series",
    "A3": "Atlas A3 series",
    "inference": "Atlas inference series",
    "200I/500 A2": "Atlas 200I/500 A2",
}


def chip_family(soc_name: str | None) -> str | None:
    """The product family ('training', 'A2', 'A3', 'inference', '200I/500 A2') of a SoC name, or None."""
    if not soc_name:
        return None
    for pattern, family in CHIP_FAMILIES:
        if pattern.fullmatch(soc_name.strip()):
            return family
    return None


def soc_name(device: torch.device | str | None = None) -> str | None:
    """The SoC name of an NPU (e.g. 'Ascend910B2'), or None off NPU or when torch_npu cannot say."""
    if device is not None and device_type(device) != "npu":
        return None
    if not npu_available():
        return None
    try:
        name = torch.npu.get_device_name(None if device is None else device_index(device))
    except Exception:  # a driver error: the family stays unknown and the eager code runs
        return None
    return str(name) or None


# --------------------------------------------------------------------------------------------
# collective timeouts: ddp_timeout is the one setting; HCCL_EXEC_TIMEOUT is derived from it
# --------------------------------------------------------------------------------------------

HCCL_WATCHDOG_DEFAULT_S = 1800
#: The switches that turn torch_npu's HCCL watchdog off, each (current name, the name before torch_npu 2.13),
#: with the value that turns it off. The current name wins when both are set (ProcessGroupHCCL.hpp).
WATCHDOG_SWITCHES: tuple[tuple[tuple[str, str], str], ...] = (
    (("TORCH_HCCL_ASYNC_ERROR_HANDLING", "HCCL_ASYNC_ERROR_HANDLING"), "0"),
    (("TORCH_HCCL_BLOCKING_WAIT", "HCCL_BLOCKING_WAIT"), "1"),
)


def watchdog_switch(env: Mapping[str, str] = os.environ) -> str:
    """The variable (``NAME=value``) that turns torch_npu's HCCL watchdog off here, or '' when it is on."""
    for names, off in WATCHDOG_SWITCHES:
        name = next((n for n in names if env.get(n) is not None and env.get(n) != ""), None)
        if name is not None and env[name].strip() == off:
            return f"{name}={off}"
    return ""


def watchdog_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether torch_npu's HCCL watchdog runs (on unless one of :data:`WATCHDOG_SWITCHES` turns it off)."""
    return not watchdog_switch(env)
#: HCCL_EXEC_TIMEOUT = ddp_timeout - this margin, so HCCL reports a stuck collective (and writes its
#: plog) before torch_npu's watchdog tears the process group down at ddp_timeout.
HCCL_EXEC_MARGIN_S = 60
#: Atlas training / inference series: HCCL rounds HCCL_EXEC_TIMEOUT down to a multiple of 68 s (minimum 68).
HCCL_EXEC_STEP_S = 68
#: A2/A3 with HCCL_OP_EXPANSION_MODE=AIV: HCCL_EXEC_TIMEOUT is capped at 1091 s (0 also means 1091).
HCCL_EXEC_AIV_CAP_S = 1091


@dataclass(frozen=True)
class CollectiveTimeouts:
    """The timeouts a run uses: what to pass to init_process_group and what HCCL_EXEC_TIMEOUT becomes."""

    process_group: timedelta
    exec_timeout_s: int | None  # HCCL_EXEC_TIMEOUT (None off NPU)
    exec_source: str  # 'derived from ddp_timeout', 'exported', or 'n/a'
    watchdog_s: float | None  # when torch_npu's watchdog aborts a stuck collective (None off NPU)


def derived_exec_timeout(ddp_timeout: int) -> int:
    """HCCL_EXEC_TIMEOUT for a ``ddp_timeout``: ``ddp_timeout - 60`` s, at least 68 s."""
    if ddp_timeout < HCCL_EXEC_STEP_S + HCCL_EXEC_MARGIN_S:
        raise ConfigError(
            f"ddp_timeout={ddp_timeout} is too short on Ascend: HCCL_EXEC_TIMEOUT is derived as ddp_timeout - "
            f"{HCCL_EXEC_MARGIN_S} s and HCCL needs at least {HCCL_EXEC_STEP_S} s; set ddp_timeout to "
            f"{HCCL_EXEC_STEP_S + HCCL_EXEC_MARGIN_S} or more"
        )
    return ddp_timeout - HCCL_EXEC_MARGIN_S


def collective_timeouts(device: torch.device | str, ddp_timeout: int, env: Mapping[str, str] = os.environ) -> CollectiveTimeouts:
    """Consistent collective timeouts for a run whose process-group timeout is ``ddp_timeout`` seconds.

    Off NPU the process group simply gets ``ddp_timeout``. On NPU HCCL_EXEC_TIMEOUT is derived
    (``ddp_timeout - 60`` s) unless exported, and an exported value must be below ``ddp_timeout``.
    torch_npu's watchdog then uses the process-group timeout as given, on every release, except
    that from 7.1 on (pip 2.1.0.post13, 2.5.1.post1, 2.6.0, ...) exactly 1800 s counts as unset and
    becomes HCCL_EXEC_TIMEOUT + 1800 s; so 1800 s is passed as 1800.001 s (harmless before 7.1,
    where a set HCCL_EXEC_TIMEOUT leaves the timeout as given). Pure: see apply_collective_timeouts.
    """
    if ddp_timeout <= 0:
        raise ConfigError(f"ddp_timeout must be a positive number of seconds, got {ddp_timeout}")
    if device_type(device) != "npu":
        return CollectiveTimeouts(timedelta(seconds=ddp_timeout), None, "n/a", None)
    exported = env.get("HCCL_EXEC_TIMEOUT")
    if exported:
        try:
            exec_timeout = int(exported)
        except ValueError:
            raise ConfigError(f"HCCL_EXEC_TIMEOUT={exported!r} is not a whole number of seconds; unset it (it is "
                              f"derived from ddp_timeout) or export an integer") from None
        if not 0 < exec_timeout < ddp_timeout:
            raise ConfigError(
                f"HCCL_EXEC_TIMEOUT={exported} does not fit ddp_timeout={ddp_timeout}: torch_npu's watchdog aborts "
                f"the process group at ddp_timeout, so HCCL's own timeout must be shorter (and not 0 = never). Unset "
                f"HCCL_EXEC_TIMEOUT to derive it ({derived_exec_timeout(ddp_timeout) if ddp_timeout >= 128 else 'n/a'} s), "
                f"and change ddp_timeout to change both"
            )
        source = "exported"
    else:
        exec_timeout, source = derived_exec_timeout(ddp_timeout), "derived from ddp_timeout"
    group = timedelta(seconds=ddp_timeout)
    if ddp_timeout == HCCL_WATCHDOG_DEFAULT_S:
        group += timedelta(milliseconds=1)  # not the sentinel value torch_npu 7.1+ replaces
    return CollectiveTimeouts(group, exec_timeout, source, group.total_seconds())


_derived_here: dict[str, str] = {}  # what apply_collective_timeouts exported in this process


def apply_collective_timeouts(device: torch.device | str, ddp_timeout: int,
                              env: MutableMapping[str, str] = os.environ) -> timedelta:
    """Export the derived HCCL_EXEC_TIMEOUT on NPU and return the process-group timeout to pass.

    Call before the process group is created (HCCL and torch_npu read the variable then).
    """
    if env.get("HCCL_EXEC_TIMEOUT") and env.get("HCCL_EXEC_TIMEOUT") == _derived_here.get("HCCL_EXEC_TIMEOUT"):
        del env["HCCL_EXEC_TIMEOUT"]  # derived for an earlier run in this process, not exported by the user
    timeouts = collective_timeouts(device, ddp_timeout, env)
    if timeouts.exec_timeout_s is not None and timeouts.exec_source != "exported":
        env["HCCL_EXEC_TIMEOUT"] = _derived_here["HCCL_EXEC_TIMEOUT"] = str(timeouts.exec_timeout_s)
        logger.info("HCCL_EXEC_TIMEOUT=%d (ddp_timeout %d s - %d s)", timeouts.exec_timeout_s, ddp_timeout,
                    HCCL_EXEC_MARGIN_S)
    return timeouts.process_group


def effective_exec_timeout(exec_timeout: int, family: str | None, env: Mapping[str, str] = os.environ) -> int:
    """What HCCL makes of an HCCL_EXEC_TIMEOUT on a chip family (CANN's environment variable reference).

    Atlas training / inference series: rounded down to a multiple of 68 s (at least 68, at most
    17340). A2/A3: whole seconds as given, except in AIV expansion mode (HCCL_OP_EXPANSION_MODE=AIV),
    where 0 or anything above 1091 s becomes 1091 s.
    """
    if family in ("training", "inference"):
        return min(max(HCCL_EXEC_STEP_S, exec_timeout // HCCL_EXEC_STEP_S * HCCL_EXEC_STEP_S), 17340)
    if family in ("A2", "A3") and env.get("HCCL_OP_EXPANSION_MODE", "").upper() == "AIV":
        return HCCL_EXEC_AIV_CAP_S if exec_timeout == 0 else min(exec_timeout, HCCL_EXEC_AIV_CAP_S)
    return exec_timeout
