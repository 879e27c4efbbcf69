"""A LoRA linear layer's forward and backward in matrix multiplies only.

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``. Besides the three matmuls that
costs, per layer and micro-batch, a full ``[tokens, out]`` multiply and add in the forward and
again in the backward (the scaling's gradient, then the sum of the two branches' input
gradients), each writing a fresh activation-sized tensor. Over the 7 adapted layers of every
decoder block these memory-bound passes were about a fifth of the training phase's operator time
on the CPU (random-25m, bench/profile_training.py). Here the adapter product is accumulated into the base output in
place, ``out.addmm_(x·Aᵀ, Bᵀ, alpha=scaling)``, and the backward does the same for the input
gradient, so the only full-width tensors are the output and the input gradient themselves. The
scaling is applied to the ``[tokens, r]`` factor instead: the same sums, in another order.

:func:`install` makes a model's plain LoRA linear layers (one active adapter, no variant such as
DoRA, no LoRA bias, floating-point ``nn.Linear`` base) take this path; any call it does not fit
(adapters disabled or merged, several adapters, mixed-batch ``adapter_names``) runs peft's own
forward. Under autocast the operands are cast as ``F.linear`` would cast them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend.models import compat_peft


class _LoraLinear(torch.autograd.Function):
    """``x·Wᵀ + bias + scaling · (d·Aᵀ)·Bᵀ`` with ``d`` = ``x``, or its dropout when given."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scaling: float, dropped: Tensor | None) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        d2 = x2 if dropped is None else dropped.reshape(-1, x.shape[-1])
        out = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
        down = torch.mm(d2, lora_a.t())
        out.addmm_(down, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x2 if ctx.needs_input_grad[1] else None, weight,
                              d2 if ctx.needs_input_grad[3] else None, lora_a, lora_b, down)
        ctx.scaling, ctx.in_shape, ctx.has_bias, ctx.separate = scaling, x.shape, bias is not None, dropped is not None
        return out.view(*lead, out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight, d2, lora_a, lora_b, down = ctx.saved_tensors
        s, needs = ctx.scaling, ctx.needs_input_grad
        g = grad_out.reshape(-1, grad_out.shape[-1])
        g_down = torch.mm(g, lora_b)  # [tokens, r]: the adapter branch's gradient before A, unscaled
        grad_x = grad_w = grad_bias = grad_a = grad_b = grad_dropped = None
        if ctx.separate:  # dropout between x and A: each input gets its own branch's gradient
            if needs[0]:
                grad_x = torch.mm(g, weight).view(ctx.in_shape)
            if needs[6]:
                grad_dropped = torch.mm(g_down, lora_a).mul_(s).view(ctx.in_shape)
        elif needs[0]:
            grad_x = torch.mm(g, weight).addmm_(g_down, lora_a, alpha=s).view(ctx.in_shape)
        if needs[1]:
            grad_w = torch.mm(g.t(), x2)
        if ctx.has_bias and needs[2]:
            grad_bias = g.sum(0)
        if needs[3]:
            grad_a = torch.mm(g_down.t(), d2).mul_(s)
        if needs[4]:
            grad_b = torch.mm(g.t(), down).mul_(s)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None, grad_dropped


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float,
                dropout: nn.Module | None = None) -> Tensor:
    """``F.linear(x, weight, bias) + F.linear(F.linear(dropout(x), lora_a), lora_b) * scaling``, fused.

    Under autocast every operand is cast to the autocast dtype first (as ``F.linear`` would) and
    the gradients flow back through those casts.
    """
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        x, weight, lora_a, lora_b = (t.to(dtype) for t in (x, weight, lora_a, lora_b))
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(kind, enabled=False):
            return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, scaling, _dropped(x, dropout))
    return _LoraLinear.apply(x, weight, bias, lora_a, lora_b, scaling, _dropped(x, dropout))


def _dropped(x: Tensor, dropout: nn.Module | None) -> Tensor | None:
    if dropout is None or isinstance(dropout, nn.Identity) or not dropout.training or dropout.p == 0:
        return None
    return dropout(x)


class FusedLoraLinear(compat_peft.lora_linear_class()):  # type: ignore[misc]
    """peft's LoRA ``Linear`` whose plain single-adapter calls run :func:`lora_linear`."""

    computes_plain_lora = True  # what compat_peft.mergeable_adapters checks: merging it stays exact

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        parts = None if args or kwargs else compat_peft.plain_lora_parts(self, x)
        if parts is None:
            return super().forward(x, *args, **kwargs)
        return lora_linear(x, parts.weight, parts.bias, parts.lora_a, parts.lora_b, parts.scaling, parts.dropout)


def install(model: nn.Module) -> int:
    """Switch every peft LoRA ``Linear`` of ``model`` to :class:`FusedLoraLinear`; returns how many.

    Only the class changes (no weight, buffer or state-dict key does), so saving, merging and
    exporting adapters work as before, and a deep copy keeps the fused forward.
    """
    base = compat_peft.lora_linear_class()
    count = 0
    for module in compat_peft.lora_layers(model):
        if type(module) is base:
            module.__class__ = FusedLoraLinear
            count += 1
    return count
