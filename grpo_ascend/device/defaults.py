"""Per-device defaults: length buckets, weight layout for decoding, float64, decode compilation,
shared-prefix decoding and the grouped-attention budget -- each chosen by device type, with why."""

from __future__ import annotations

import importlib

import torch

from grpo_ascend.device.backends import device_type, load_torch_npu
from grpo_ascend.device.calibration import plain_operand_faster


def default_length_bucket(device: torch.device | str) -> int:
    """Length bucket when none is configured: 64 on NPU, 1 (exact lengths) elsewhere.

    Ascend graph mode compiles once per input shape, so padding lengths to multiples of 64 keeps
    the number of compilations small. Elsewhere kernels take any shape, and padding only costs
    compute: prompts of 63-65 tokens padded to 128 make a training step about a quarter slower.
    """
    return 64 if device_type(device) == "npu" else 1


def decode_weights_transposed(device: torch.device | str, weight_shape: tuple[int, int] | None = None,
                              rows: int | None = None, dtype: torch.dtype = torch.float32) -> bool:
    """Whether a weight copied for decoding (the rollout's LoRA-merged copy) is stored ``[in, out]``.

    On the CPU, ``F.linear(x, W)`` with a row-major ``W`` [out, in] asks MKL's sgemm for a
    transposed operand; stored ``[in, out]`` and seen through ``.t()``, the same weight is a plain
    one. Which runs faster at decode sizes depends on the CPU's instruction set, the shape and the
    thread count (calibration.py), so with ``weight_shape`` [out, in] and the decode's ``rows`` it
    is measured once per shape; without them the plain form (the faster one on AVX-512 Xeons, at
    worst even on AVX2). Accelerators keep their own layout: their matmul libraries take either,
    and Ascend kernels want ND weights.
    """
    if device_type(device) != "cpu":
        return False
    if weight_shape is None or rows is None:
        return True
    return plain_operand_faster(rows, weight_shape[1], weight_shape[0], dtype)


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
