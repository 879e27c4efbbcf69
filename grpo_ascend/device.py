"""Device layer: the only module (with ``npu_patches``) that names a device type or collective backend.

Everything else in grpo_ascend asks this module which device to use, how to autocast, how to
measure memory and how to seed, so the same code runs on Ascend NPUs, CUDA GPUs and the CPU.

``torch_npu`` is imported lazily, inside functions, and only once: on a machine without the CANN
libraries importing it fails, and that must never break ``import grpo_ascend``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import random
import re
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

import numpy as np
import torch

from grpo_ascend.errors import ConfigError, DeviceError, closest

logger = logging.getLogger(__name__)

DEVICE_TYPES = ("auto", "cpu", "cuda", "npu")
ACCELERATOR_TYPES = ("npu", "cuda")

#: Runtime defaults applied on Ascend when the user has not set them (see apply_npu_runtime_defaults).
#: HCCL_EXEC_TIMEOUT is not among them: it is derived from ``ddp_timeout`` (see collective_timeouts).
NPU_RUNTIME_DEFAULTS: dict[str, str] = {
    # Socket link set-up between ranks; default 120 s is too short when ranks load a model at
    # different speeds. Valid range [120, 7200] s.
    "HCCL_CONNECT_TIMEOUT": "1200",
    # Lets the caching allocator grow segments instead of fragmenting under variable rollout lengths.
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
}

#: Environment variables shown by ``grpo-ascend doctor`` (with every other HCCL_*, ASCEND_*, PYTORCH_NPU_*).
DEVICE_ENV_VARS = (
    "ASCEND_RT_VISIBLE_DEVICES",
    "ASCEND_HOME_PATH",
    "ASCEND_TOOLKIT_HOME",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "HCCL_IF_IP",
    "HCCL_BUFFSIZE",
    "PYTORCH_NPU_ALLOC_CONF",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "LOCAL_RANK",
    "WORLD_SIZE",
)

_CANN_SET_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"


# --------------------------------------------------------------------------------------------
# torch_npu import (lazy, cached)
# --------------------------------------------------------------------------------------------


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
    could not load. Call ``load_torch_npu.cache_clear()`` to retry.
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


def _torch_version_base() -> str:
    return torch.__version__.split("+", 1)[0]


def _npu_missing_message() -> str:
    base = _torch_version_base()
    return (
        f"device 'npu' requested but torch_npu is not installed; install the Ascend adapter that "
        f"matches torch {base} with `pip install \"torch-npu=={base}.*\"` (or `pip install "
        f"'grpo-ascend[npu]'`) on a machine with the CANN toolkit, or choose --device auto/cuda/cpu"
    )


def _npu_import_failed_message(error: BaseException) -> str:
    return (
        f"torch_npu is installed but importing it failed ({type(error).__name__}: {error}); its CANN "
        f"libraries probably did not load: run `{_CANN_SET_ENV}` (the set_env.sh of your CANN toolkit) "
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


@functools.lru_cache(maxsize=1)
def _warn_npu_import_failed(message: str) -> None:
    logger.warning("%s; falling back to another device", message)


def _npu_available() -> bool:
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


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


# --------------------------------------------------------------------------------------------
# detection and resolution
# --------------------------------------------------------------------------------------------


def detect_device_type() -> str:
    """Return 'npu' if torch_npu imports and sees an NPU, else 'cuda' if available, else 'cpu'."""
    if _npu_available():
        return "npu"
    if _cuda_available():
        return "cuda"
    return "cpu"


def _split(device: torch.device | str) -> tuple[str, int | None]:
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
    return _split(device)[0]


def _backend_module(kind: str) -> Any:
    """torch.cuda or torch.npu (importing torch_npu first) for an accelerator type."""
    if kind == "cuda":
        return torch.cuda
    if kind == "npu":
        import_torch_npu()
        return torch.npu  # registered by torch_npu on import
    raise DeviceError(f"device type {kind!r} has no accelerator backend; expected one of {ACCELERATOR_TYPES}")


def _index(device: torch.device | str) -> int:
    kind, index = _split(device)
    if index is not None:
        return index
    return int(_backend_module(kind).current_device())


def _local_rank(local_rank: int | None) -> int:
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
    kind, index = _split(requested)
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
        if not _npu_available():
            visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "<unset>")
            raise DeviceError(
                f"device {requested!r} requested but torch_npu reports no NPU (torch.npu.is_available() is "
                f"False); check `npu-smi info`, the Ascend driver, and ASCEND_RT_VISIBLE_DEVICES={visible}"
            )
        applied = apply_npu_runtime_defaults()
        if applied:
            logger.info("applied Ascend runtime defaults: %s", applied)
    elif kind == "cuda" and not _cuda_available():
        built = torch.version.cuda or "none (this is a CPU-only torch build)"
        raise DeviceError(
            f"device {requested!r} requested but CUDA is not available (torch {torch.__version__}, "
            f"CUDA runtime {built}); install a CUDA build of torch, check `nvidia-smi` and "
            f"CUDA_VISIBLE_DEVICES, or choose --device auto/cpu"
        )
    module = _backend_module(kind)
    count = int(module.device_count())
    position = index if index is not None else _local_rank(local_rank)
    if index is None and count == 1:
        position = 0  # the launcher bound one device to this process (per-rank visible devices)
    if position >= count:
        raise DeviceError(
            f"device index {position} for {kind!r} is out of range: {count} {kind} device(s) visible to "
            f"this process; use an index below {count} or fix the launcher's LOCAL_RANK / visible devices"
        )
    module.set_device(position)
    return torch.device(f"{kind}:{position}")


def tune_host_allocator(device: torch.device | str, env: Mapping[str, str] = os.environ) -> int | None:
    """On the CPU, fix glibc's mmap threshold (unless the user set one) so freed tensors return to the OS.

    Otherwise glibc serves tensors from its heap, whose freed space stays resident: peak RSS 1.00-1.03 GiB
    instead of 0.88 GiB on bench/bench_random_model.py (see grpo_ascend/host_allocator.py).
    Returns the threshold set, or None (another device, not glibc, or the user's own setting).
    Called by :func:`resolve_device` for the CPU.
    """
    if device_type(device) != "cpu":
        return None
    from grpo_ascend.host_allocator import fix_mmap_threshold

    return fix_mmap_threshold(env)


def device_count(kind: str | None = None) -> int:
    """Number of devices of ``kind`` (default: the detected type) visible here; 1 for the CPU."""
    kind = kind or detect_device_type()
    if kind == "cpu":
        return 1
    if kind == "npu" and not _npu_available():
        return 0
    if kind == "cuda" and not _cuda_available():
        return 0
    return int(_backend_module(kind).device_count())


def dist_backend(device: torch.device | str) -> str:
    """torch.distributed backend for a device: 'hccl' on NPU, 'nccl' on CUDA, 'gloo' otherwise."""
    return {"npu": "hccl", "cuda": "nccl"}.get(device_type(device), "gloo")


def default_length_bucket(device: torch.device | str) -> int:
    """Length bucket when none is configured: 64 on NPU, 1 (exact lengths) elsewhere.

    Ascend graph mode compiles once per input shape, so padding lengths to multiples of 64 keeps
    the number of compilations small. Elsewhere kernels take any shape, and padding only costs
    compute: prompts of 63-65 tokens padded to 128 make a training step about a quarter slower.
    """
    return 64 if device_type(device) == "npu" else 1


def decode_weights_transposed(device: torch.device | str) -> bool:
    """Whether weights copied for decoding (the rollout's LoRA-merged copy) are stored ``[in, out]``.

    On the CPU, ``F.linear(x, W)`` with a row-major ``W`` [out, in] asks MKL's sgemm for a
    transposed operand, which at decode sizes (8-64 rows) runs far below the plain layout:
    bench/gemm_decode_shapes.py measured 32 x 512 -> 1,376 at 90 vs 130 GFLOP/s on 1 thread
    and 56 vs 132 GFLOP/s on 2 (the transposed form does not scale with threads). Stored
    ``[in, out]`` and seen through ``.t()``, the same weight gives the plain form. Accelerators
    keep their own layout: their matmul libraries take either, and Ascend kernels want ND weights.
    """
    return device_type(device) == "cpu"


def float64_supported(device: torch.device | str) -> bool:
    """Whether float64 kernels (cumsum, searchsorted) run natively: everywhere but on the NPU.

    Ascend cores have no float64 units (such ops fall back to the AI CPU), so code with a float64
    fast path keeps its float32 formulation there.
    """
    return device_type(device) != "npu"


def _compile_with_inductor(module: torch.nn.Module) -> torch.nn.Module:
    # dynamic: one graph serves every batch-row bucket and key/value length
    return torch.compile(module, dynamic=True)


def _compile_with_torchair(module: torch.nn.Module) -> torch.nn.Module:
    # Ascend graph mode (TorchAir's GE backend) compiles per static shape: one graph per
    # (row bucket, length bucket) pair, so allow that many before dynamo falls back to eager.
    load_torch_npu()
    torchair = importlib.import_module("torchair")
    backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
    dynamo_config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 64))
    return torch.compile(module, backend=backend, dynamic=False)


_DECODE_COMPILERS = {"npu": _compile_with_torchair}


def compile_for_decode(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``module`` compiled for the rollout engine's decode step on ``device``.

    CPU and CUDA: ``torch.compile`` (inductor) with dynamic shapes. NPU: TorchAir's graph mode
    (``torchair.get_npu_backend``) with static shapes, which the length buckets keep few; untested.
    """
    return _DECODE_COMPILERS.get(device_type(device), _compile_with_inductor)(module)


def default_compile_decode(device: torch.device | str) -> bool:
    """Whether the rollout engine compiles its decode step when ``compile_decode`` is None: never yet.

    CPU: measured (docs/benchmarks.md) -- on the `small` model the compiled decode is no faster
    (0.97x at 1 thread, 0.82x at 2) and its first compile takes minutes; the decode is bound by
    its matrix multiplies, not by Python overhead. CUDA and NPU: not measured here, so opt-in.
    """
    return False


def default_shared_prefix_decode(device: torch.device | str) -> bool:
    """Whether grouped decoding reads each prompt's keys/values once (rollout/shared_prefix.py) when
    ``SamplingParams.shared_prefix`` is None: on the CPU, where a decode step's attention is bound by
    its reads of the KV cache and the G copies of the prompt are most of them (bench/bench_rollout.py
    measures it). CUDA and NPU have fused decode-attention kernels and are not measured here: opt-in.
    """
    return device_type(device) == "cpu"


def grouped_attention_max_bytes(device: torch.device | str) -> int:
    """Largest per-layer score block (bytes of ``[rows, heads, queries, keys]`` probabilities) that the
    log-prob forwards compute as two batched matmuls (grpo_ascend/models/grouped_attention.py) instead of SDPA.

    CPU: 8 MiB -- SDPA's flash kernel runs a GRPO micro-batch's short masked blocks at about half
    the batched matmuls' rate, but keeps no probabilities for backward, so long sequences stay on
    it (bench/ab_training_attention.py). CUDA and NPU: 0 (their fused SDPA kernels are the fast path).
    """
    return 8 << 20 if device_type(device) == "cpu" else 0


def is_accelerator(device: torch.device | str) -> bool:
    """True for NPU and CUDA devices."""
    return device_type(device) in ACCELERATOR_TYPES


# --------------------------------------------------------------------------------------------
# synchronisation and memory
# --------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str) -> None:
    """Wait for all queued work on the device (no-op on the CPU); use before timing."""
    kind = device_type(device)
    if kind in ACCELERATOR_TYPES:
        _backend_module(kind).synchronize(_index(device))


def empty_cache(device: torch.device | str) -> None:
    """Return cached, unused blocks of the device allocator to the driver (no-op on the CPU)."""
    kind = device_type(device)
    if kind in ACCELERATOR_TYPES:
        _backend_module(kind).empty_cache()


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
        module = _backend_module(kind)
        index = _index(device)
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
        _backend_module(kind).reset_peak_memory_stats(_index(device))
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
        free, total = _backend_module(kind).mem_get_info(_index(device))
        return int(free), int(total)
    return _host_memory()


# --------------------------------------------------------------------------------------------
# precision
# --------------------------------------------------------------------------------------------

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
        return _cuda_available() and bool(torch.cuda.is_bf16_supported())
    if kind == "npu":
        return _npu_available() and bool(torch.npu.is_bf16_supported())
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


def mixed_precision_for_accelerate(bf16: bool, fp16: bool) -> str:
    """accelerate's ``mixed_precision`` value for the bf16/fp16 config switches."""
    if bf16 and fp16:
        raise ConfigError("bf16 and fp16 are both true; enable at most one of them")
    if bf16:
        return "bf16"
    if fp16:
        return "fp16"
    return "no"


# --------------------------------------------------------------------------------------------
# randomness
# --------------------------------------------------------------------------------------------


def _loaded_npu() -> Any | None:
    """torch.npu if torch_npu is already imported (seeding must not trigger the import)."""
    if sys.modules.get("torch_npu") is None:
        return None
    return getattr(torch, "npu", None)


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy, torch (CPU) and every CUDA/NPU device for reproducible runs."""
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if _cuda_available():
        torch.cuda.manual_seed_all(seed)
    npu = _loaded_npu()
    if npu is not None:
        npu.manual_seed_all(seed)


def rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """Capture python, numpy, torch CPU and (for an accelerator ``device``) its RNG state.

    The result holds only tensors and plain Python containers, so a checkpoint can be read back
    with ``torch.load(weights_only=True)``.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if device is not None and is_accelerator(device):
        kind_name = device_type(device)
        state["device_type"] = kind_name
        state["device"] = _backend_module(kind_name).get_rng_state(_index(device))
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device | str | None = None) -> None:
    """Restore a state from :func:`rng_state` so the next random draws are identical.

    The device part is restored only when ``device`` has the same type as the one captured
    (resuming an NPU run on a GPU restores the host RNGs and logs a warning).
    """
    missing = [key for key in ("python", "numpy", "torch") if key not in state]
    if missing:
        raise ConfigError(f"RNG state is missing {missing}; expected the dict returned by rng_state()")
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "device" not in state or device is None:
        return
    saved_type = state.get("device_type")
    if device_type(device) != saved_type:
        logger.warning(
            "RNG state was saved on %s but the run is on %s; device RNG not restored", saved_type, device_type(device)
        )
        return
    _backend_module(saved_type).set_rng_state(state["device"], _index(device))


# --------------------------------------------------------------------------------------------
# Ascend runtime environment
# --------------------------------------------------------------------------------------------


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


def _package_version(dist_name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def cann_version() -> str | None:
    """CANN toolkit version reported by torch_npu, or None if unknown or torch_npu is unusable."""
    module = load_torch_npu().module
    if module is None:
        return None
    version = getattr(torch.version, "cann", None)
    if version:
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
        if found:
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
    if not _npu_available():
        return None
    try:
        name = torch.npu.get_device_name(None if device is None else _index(device))
    except Exception:  # a driver error: the family stays unknown and the eager code runs
        return None
    return str(name) or None


# --------------------------------------------------------------------------------------------
# collective timeouts: ddp_timeout is the one setting; HCCL_EXEC_TIMEOUT is derived from it
# --------------------------------------------------------------------------------------------

#: torch_npu's default process-group timeout (DEFAULT_TIMEOUT in ProcessGroupHCCL.hpp), in seconds.
HCCL_WATCHDOG_DEFAULT_S = 1800
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


# --------------------------------------------------------------------------------------------
# facts for ``grpo-ascend doctor`` (grpo_ascend/doctor.py lays them out)
# --------------------------------------------------------------------------------------------


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


def device_facts(device: torch.device | str | None = None) -> dict[str, Any]:
    """Type, count, name, chip family, bf16, collective backend and free memory of a device.

    ``device`` defaults to the auto-detected one (at this process's LOCAL_RANK index). Errors while
    asking the driver are reported in ``memory_error`` rather than raised.
    """
    if device is None:
        kind = detect_device_type()
        device = kind if kind == "cpu" else f"{kind}:{_local_rank(None)}"
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
            facts["device_name"] = str(_backend_module(kind).get_device_name(_index(device)))
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
    if env.get("HCCL_ASYNC_ERROR_HANDLING") == "0" or env.get("HCCL_BLOCKING_WAIT") == "1":
        facts["HCCL watchdog"] = "off (HCCL_ASYNC_ERROR_HANDLING=0 or HCCL_BLOCKING_WAIT=1)"
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
            f"run `{_CANN_SET_ENV}` or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 if this machine has no NPU"
        ]
    return []
