"""LoRA folded into the base weights for rollouts: one matmul per linear layer while sampling, the
original weights swapped back bit-for-bit afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.models import compat_peft
from grpo_ascend.models.compat_peft import base_weight, delta_weight, plain_lora_parts, set_adapter_path
from grpo_ascend.models.wrappers import is_peft


def _mergeable_lora_layers(model: nn.Module) -> list[tuple[nn.Module, list[str]]] | None:
    """(layer, active adapters) of every LoRA layer with adapters on, or None if one can't be merged.

    Only plain linear LoRA layers qualify: variants (DoRA, ...) and quantised or custom layer types
    compute more than ``W + B·A·scaling``.
    """

    found = []
    for module in compat_peft.lora_layers(model):
        active = compat_peft.mergeable_adapters(module)
        if active is None:
            return None
        if active:
            found.append((module, active))
    return found


def lora_merge_bytes(model: nn.Module) -> int | None:
    """Extra bytes :func:`lora_merged` holds (a merged copy of each adapted weight); None if it can't merge."""
    layers = _mergeable_lora_layers(model) if is_peft(model) else None
    if not layers:
        return None

    return sum(base_weight(m).nbytes for m, _ in layers)


def _fold_adapters(module: nn.Module, active: list[str], original: Tensor, out: Tensor) -> None:
    """``out = original + Σ B·A·scaling`` over the ``active`` adapters of ``module``.

    One plain adapter folds in a single ``addmm`` computed on the side where ``out`` is contiguous
    (``Wᵀ + s·Aᵀ·Bᵀ`` into an ``[in, out]`` buffer): writing an elementwise sum through a transposed
    view runs about 5x slower (7 ms instead of 1.3 for a 1,376 x 512 weight on one core), and the
    full-size delta is never built. Anything else goes through peft's own ``get_delta_weight``.
    """

    parts = plain_lora_parts(module, original) if len(active) == 1 else None
    if parts is None or parts.lora_a.dtype != original.dtype or parts.lora_b.dtype != original.dtype:
        torch.add(original, sum(delta_weight(module, a) for a in active).to(original.dtype), out=out)
    elif out.is_contiguous():
        torch.addmm(original, parts.lora_b, parts.lora_a, alpha=parts.scaling, out=out)
    else:
        torch.addmm(original.t(), parts.lora_a.t(), parts.lora_b.t(), alpha=parts.scaling, out=out.t())


@contextlib.contextmanager
def lora_merged(model: nn.Module, rows: int | None = None) -> Iterator[bool]:
    """Inference with the active LoRA adapters folded into the base weights; yields whether it merged.

    Each adapted base weight is swapped for ``W + Σ B·A·scaling`` and the layer's adapter path is
    switched off, so a forward costs one matmul per linear layer instead of three -- what makes
    token-by-token generation with LoRA slow. The originals are kept and swapped back on exit, so
    the base weights are bit-for-bit unchanged (no ``W + Δ - Δ`` rounding drift). Costs a copy of
    the adapted weights while active. Not for training inside the block: gradients would not reach
    the adapters.

    The merged copy is laid out as the device's decode matmuls read fastest
    (:func:`grpo_ascend.device.decode_weights_transposed`, measured per shape on the CPU for decode
    batches of ``rows`` sequences): stored ``[in, out]`` and seen through a transposed view,
    ``F.linear`` hands the BLAS a plain (not transposed) operand -- at 16-64 rows MKL's sgemm ran
    that up to 1.8x faster on an AVX-512 Xeon, and about as fast capped at AVX2
    (bench/gemm_decode_shapes.py).
    """
    layers = _mergeable_lora_layers(model) if is_peft(model) else None
    if not layers:
        yield False
        return

    swapped: list[tuple[nn.Module, Tensor]] = []
    try:
        with torch.no_grad():
            for module, active in layers:
                weight = base_weight(module)
                original = weight.data
                transposed = original.dim() == 2 and dev.decode_weights_transposed(
                    original.device, tuple(original.shape), rows, original.dtype)
                merged = original.new_empty(original.shape[::-1]).t() if transposed else torch.empty_like(original)
                _fold_adapters(module, active, original, merged)
                weight.data = merged
                swapped.append((module, original))
                set_adapter_path(module, False)
        yield True
    finally:
        for module, original in swapped:
            base_weight(module).data = original
            set_adapter_path(module, True)
