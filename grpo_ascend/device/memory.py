"""Synchronisation and memory: waiting for a device, its allocator's statistics and free memory;
on the CPU, the process's resident set and the host's RAM."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from grpo_ascend.device.backends import ACCELERATOR_TYPES, backend_module, device_index, device_type


def synchronize(device: torch.device | str) -> None:
    """Wait for all queued work on the device (no-op on the CPU); use before timing."""
    kind = device_type(device)
    if kind in ACCELERATOR_TYPES:
        backend_module(kind).synchronize(device_index(device))


def empty_cache(device: torch.device | str) -> None:
    """Return cached, unused blocks of the device allocator to the driver (no-op on the CPU)."""
    kind = device_type(device)
    if kind in ACCELERATOR_TYPES:
        backend_module(kind).empty_cache()


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_bytes() -> int:
    kib = _proc_status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    kib = _proc_status_kib("VmHWM")  # resettable through /proc/self/clear_refs
    if kib is not None:
        return kib * 1024
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def memory_stats(device: torch.device | str) -> dict[str, int]:
    """Memory in bytes: ``allocated`` (live tensors), ``reserved`` (held by the allocator), ``peak``.

    On an accelerator these come from the caching allocator (peak = max allocated since the last
    reset_peak_memory). On the CPU there is no allocator to ask, so allocated and reserved are the
    process resident set size (RSS) and peak is the peak RSS (VmHWM on Linux, else
    resource.getrusage's ru_maxrss); they include everything the process holds, not only tensors.
    """
    kind = device_type(device)
    if kind in ACCELERATOR_TYPES:
        module = backend_module(kind)
        index = device_index(device)
        return {
            "allocated": int(module.memory_allocated(index)),
            "reserved": int(module.memory_reserved(index)),
            "peak": int(module.max_memory_allocated(index)),
        }
    rss = _rss_bytes()
    return {"allocated": rss, "reserved": rss, "peak": max(_peak_rss_bytes(), rss)}


def reset_peak_memory(device: torch.device | str) -> None:
    """Restart peak tracking. On the CPU (Linux) this resets VmHWM; elsewhere on the CPU it is a no-op."""
    kind = device_type(device)
    if kind in ACCELERATOR_TYPES:
        backend_module(kind).reset_peak_memory_stats(device_index(device))
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")


def _host_memory() -> tuple[int, int]:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    values[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        values = {}
    if "MemAvailable" in values and "MemTotal" in values:
        return values["MemAvailable"], values["MemTotal"]
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):
        return 0, 0


def free_memory(device: torch.device | str) -> tuple[int, int]:
    """(free, total) bytes of device memory; on the CPU, available and total host RAM (0, 0 if unknown)."""
    kind = device_type(device)
    if kind in ACCELERATOR_TYPES:
        free, total = backend_module(kind).mem_get_info(device_index(device))
        return int(free), int(total)
    return _host_memory()
