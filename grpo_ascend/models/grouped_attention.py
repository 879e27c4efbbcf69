"""Attention for the log-prob forwards' short blocks: grouped-query attention as two batched matmuls.

The training and reference forwards run a GRPO micro-batch's prompt and completions (a few hundred
positions at most) through SDPA with a padding mask. On the CPU that lands in SDPA's flash kernel,
which runs such short masked blocks slowly, and transformers first copies every key/value head to
its query heads (``repeat_kv``). :func:`grouped_attention_forward` instead stacks the ``g`` query
heads of each key/value head as extra query rows, so one batched matmul per (row, kv head) reads the
keys once; the mask enters as an additive bias, the softmax runs in float32, and a second batched
matmul reads the values. It is exact softmax attention, equal to SDPA up to float rounding. For
random-25m's completion block alone, forward + backward take 4.8 instead of 9.1 ms at 2 threads;
a whole training micro-batch 0.88x the time at 2 threads and the same at 1
(bench/ab_training_attention.py).

The price is memory: autograd keeps the probabilities ``[rows, heads, queries, keys]`` of every
layer where the flash kernel keeps a log-sum-exp per query. So a call takes this path only when
that block is at most :func:`grpo_ascend.device.grouped_attention_max_bytes` (0 on accelerators)
and hands everything else to transformers' own SDPA function: larger blocks, dropout, soft-capping,
attention sinks, position biases and non-float32 inputs. :func:`grouped_attention` switches a model
to it for the duration of a forward; under activation checkpointing it does nothing, because the
backward's recomputation would run the other implementation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.models.attention_switch import (
    activation_checkpointing_on,
    attention_implementation,
    register,
)

IMPLEMENTATION = "grpo_ascend_grouped_sdpa"
#: Keyword arguments that only transformers' SDPA function implements.
_DELEGATED = ("softcap", "s_aux", "position_bias")


def grouped_attention_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention-interface entry: output ``[B, Lq, heads, D]`` (and no attention weights).

    ``query`` [B, heads, Lq, D], ``key``/``value`` [B, kv_heads, Lk, D]; ``attention_mask`` is SDPA's
    (boolean, True = attend, or an additive float mask; None = causal or nothing to mask).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, queries, dim = query.shape
    scores_bytes = rows * heads * queries * key.shape[2] * 4
    if (dropout or any(kwargs.get(name) is not None for name in _DELEGATED)
            or {query.dtype, key.dtype, value.dtype} != {torch.float32}
            or heads % key.shape[1] or scores_bytes > dev.grouped_attention_max_bytes(query.device)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and queries > 1:
        key, value = key[:, :, :queries], value[:, :, :queries]  # SDPA's is_causal aligns to the first key
        bias = torch.full((queries, queries), torch.finfo(query.dtype).min, device=query.device).triu_(1)
    elif attention_mask is None:
        bias = None
    else:
        mask = attention_mask[..., : key.shape[2]]
        bias = mask if mask.dtype != torch.bool else torch.zeros(
            (), dtype=query.dtype, device=query.device).masked_fill(~mask, torch.finfo(query.dtype).min)
    scale = scaling if scaling is not None else dim**-0.5
    with torch.autocast(query.device.type, enabled=False):
        return grouped_softmax_attention(query, key, value, bias, scale), None


def grouped_softmax_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None,
                              scale: float) -> Tensor:
    """``softmax(q·kᵀ·scale + bias)·v``, output ``[B, Lq, heads, D]``, with each kv head's query heads stacked
    as query rows (``query`` [B, heads, Lq, D], ``key``/``value`` [B, kv_heads, Lk, D]; ``bias`` additive,
    broadcast to the scores, or None): what :func:`grouped_attention_forward` runs when it keeps a call."""
    rows, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads  # query head h reads key/value head h // group
    q = query.reshape(rows * kv_heads, group * queries, dim)
    scores = torch.bmm(q, key.reshape(rows * kv_heads, keys, dim).transpose(1, 2))
    scores = scores.view(rows, kv_heads, group, queries, keys)
    if bias is not None:
        # A masked row (a left-padding query) gets equal scores at the float minimum: uniform weights
        # instead of SDPA's NaN-free zeros; no loss reads those positions.
        bias = bias.reshape(*bias.shape[:-3], 1, *bias.shape[-3:]) if bias.dim() == 4 else bias
        scores = torch.add(bias, scores, alpha=scale)
    else:
        scores = scores * scale
    probs = torch.softmax(scores, dim=-1).view(rows * kv_heads, group * queries, keys)
    out = torch.bmm(probs, value.reshape(rows * kv_heads, keys, dim))
    return out.view(rows, heads, queries, dim).transpose(1, 2).contiguous()


def _register() -> None:
    """Make :data:`IMPLEMENTATION` a transformers attention implementation with SDPA's masks."""
    register(IMPLEMENTATION, grouped_attention_forward, masks_like="sdpa")


@contextlib.contextmanager
def grouped_attention(model: nn.Module) -> Iterator[bool]:
    """Inside the block ``model`` (a transformers model on SDPA) attends with :func:`grouped_attention_forward`;
    yields whether it switched. No switch for other implementations, on devices whose budget is 0,
    or under activation checkpointing."""
    config = getattr(model, "config", None)
    parameter = next(model.parameters(), None)
    if (config is None or parameter is None or getattr(config, "_attn_implementation", None) != "sdpa"
            or dev.grouped_attention_max_bytes(parameter.device) == 0 or activation_checkpointing_on(model)):
        yield False
        return
    _register()
    with attention_implementation(config, IMPLEMENTATION):
        yield True
