"""What a benchmark figure was measured on: the CPU model, the instruction set torch uses, threads.

Every benchmark prints :func:`describe` beside its figures, because ratios measured on one CPU kind
(an Intel with AVX-512, an AMD EPYC with AVX2 only) need not hold on the other.

``--isa avx2`` in the benchmarks that take it approximates an AVX2-only CPU on an AVX-512 one with
:func:`isa_environment`: ATen's vectorised kernels, MKL's BLAS and oneDNN are each capped at AVX2.
The proxy caps the instruction set, not the memory system or clock, so it is an approximation.
"""

from __future__ import annotations

import os
import platform

#: Environment that caps torch's CPU kernels at an instruction set (set before torch is imported).
_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def isa_environment(isa: str | None) -> dict[str, str]:
    """Environment variables that make a worker run as on a CPU with only ``isa`` (None: as it is)."""
    if isa in (None, "native"):
        return {}
    if isa not in _ISA_ENV:
        raise SystemExit(f"--isa {isa!r} is not supported; expected native or {', '.join(_ISA_ENV)}")
    return dict(_ISA_ENV[isa])


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def hardware_isa() -> str:
    """The widest vector instruction set the CPU has: AVX-512 (with AMX where present), AVX2 or less."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "AVX-512" + (" + AMX" if "amx_tile" in flags else "")
    return "AVX2" if "avx2" in flags else "no AVX2"


def describe(threads: int | str | None = None) -> str:
    """One line: CPU model, its instruction set, the one torch's kernels use here, the cap if any, and
    ``threads`` (a count or a list such as "1,2"; default torch's current count)."""
    import torch

    used = torch.backends.cpu.get_cpu_capability()
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    parts = [cpu_model(), f"hardware {hardware_isa()}", f"torch kernels {used}"]
    if cap:
        parts.append(f"capped by ATEN_CPU_CAPABILITY={cap}, MKL_ENABLE_INSTRUCTIONS="
                     f"{os.environ.get('MKL_ENABLE_INSTRUCTIONS', '-')}, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}")
    parts.append(f"{threads if threads is not None else torch.get_num_threads()} thread(s), {os.cpu_count()} CPUs")
    return "; ".join(parts)
