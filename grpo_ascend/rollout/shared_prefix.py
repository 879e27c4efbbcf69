"""Decode attention that reads a GRPO group's shared prompt once instead of once per completion.

In grouped sampling the G completions of a prompt attend to the same prompt keys and values. The
plain cache (:class:`~grpo_ascend.rollout.kv_cache.BucketedKVCache`) holds G copies of them and
attention reads every copy at every step; on the CPU a decode step's attention is bound by those
reads. :class:`SharedPrefixKVCache` keeps the prompt part once per prompt ``[P, kv_heads, Lp, D]``
and only the completions per row ``[B, kv_heads, Lc, D]``, and :func:`shared_prefix_attention`
computes each layer's attention in two parts under one softmax:

* the prompt part: the queries of a group's rows are gathered into one block per prompt (a row's
  query heads become extra query rows of its key/value head), so one matmul per prompt reads its
  keys and values once;
* the completion part: a batched matmul over each row's own keys and values;
* one softmax over both parts' scores (the prompt's left padding masked out), so the result is
  exact attention over ``prompt + completion``, equal to the plain cache's up to float rounding.

It serves single-token decode steps of decoders whose attention is plain causal softmax attention
(no sliding window, logit soft-capping or attention sinks), see :func:`supports_shared_prefix`;
the engine checks that before using it. The attention implementation is switched only inside
:func:`shared_prefix_decoding` (the prefill and every training forward keep theirs), and with it
transformers builds no per-step mask: the cache knows which columns are valid.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.attention_switch import attention_implementation, register
from grpo_ascend.models.layer_kinds import text_decoder_config
from grpo_ascend.rollout.kv_cache import BucketedKVCache

IMPLEMENTATION = "grpo_ascend_shared_prefix"
#: Attention implementations whose math the shared-prefix attention reproduces.
PLAIN_IMPLEMENTATIONS = ("sdpa", "eager")

_ACTIVE: contextvars.ContextVar[SharedPrefixKVCache | None] = contextvars.ContextVar(
    "grpo_ascend_shared_prefix_cache", default=None
)


class _RowLayout:
    """Where each decode row's query goes in the per-prompt blocks: ``slots`` [B] into ``P × width``.

    ``row_prompt`` [B] is each row's prompt (an index into the prompt part). Rows of one prompt take
    consecutive slots of its block; ``identity`` when the rows already are the blocks in order (every
    prompt has ``width`` rows, grouped), which skips the gather and scatter. ``bias`` [B, 1, 1, Lp]
    masks each row's prompt padding.
    """

    def __init__(self, row_prompt: list[int], prompt_valid: Tensor) -> None:
        self.num_prompts = prompt_valid.shape[0]
        counts = [0] * self.num_prompts
        slots = []
        for p in row_prompt:
            slots.append(counts[p])  # the row's rank within its prompt
            counts[p] += 1
        self.width = max(counts, default=1)
        slots = [p * self.width + k for p, k in zip(row_prompt, slots)]
        self.identity = slots == list(range(self.num_prompts * self.width))
        device = prompt_valid.device
        self.row_prompt = torch.tensor(row_prompt, dtype=torch.long, device=device)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        bias = torch.zeros(prompt_valid.shape, dtype=torch.float32, device=device).masked_fill(
            ~prompt_valid, float("-inf"))
        self.bias = bias.index_select(0, self.row_prompt)[:, None, None, :]


class SharedPrefixLayer(CacheLayerMixin):
    """One layer: the prompts' keys/values once per prompt and each row's completion keys/values."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, prompt_keys: Tensor, prompt_values: Tensor, rows: int, capacity: int) -> None:
        super().__init__()
        # Half-precision states are kept in float32: the attention's matmuls would otherwise round the
        # scores to 8 bits of mantissa, where fused attention kernels accumulate them in float32.
        dtype = torch.promote_types(prompt_keys.dtype, torch.float32)
        # Keys stored [P, kv_heads, D, Lp]: the scores' matmul then reads a plain operand, ~1.6x faster
        # than through a transposed view at these sizes on the CPU.
        self.prompt_keys_t = prompt_keys.transpose(-1, -2).to(dtype).contiguous()
        self.prompt_values = prompt_values.to(dtype)
        heads, dim = prompt_keys.shape[1], prompt_keys.shape[-1]
        self.keys = prompt_keys.new_zeros((rows, heads, capacity, dim), dtype=dtype)
        self.values = prompt_values.new_zeros((rows, prompt_values.shape[1], capacity, prompt_values.shape[-1]),
                                              dtype=dtype)
        self.capacity = capacity
        self.length = 0
        self.device = prompt_keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:  # buffers exist already
        return None

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write the step's keys/values after the completion's and return the filled completion part."""
        start, n = self.length, key_states.shape[-2]
        if n != 1:
            raise RuntimeError(f"shared-prefix attention serves single-token decode steps, got {n} new positions")
        if start + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: writing {n} positions at {start} exceeds capacity {self.capacity}")
        self.keys[:, :, start : start + n].copy_(key_states)
        self.values[:, :, start : start + n].copy_(value_states)
        self.length = start + n
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def get_seq_length(self) -> int:
        """Positions seen per row: the (padded) prompt and the completion so far."""
        return self.prompt_keys_t.shape[-1] + self.length

    def get_max_length(self) -> int:
        return self.prompt_keys_t.shape[-1] + self.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def view_length(self, length: int) -> int:
        """Columns of the engine's attention mask for ``length`` positions (the mask is not read)."""
        return length

    def select(self, rows: Tensor, prompts: Tensor | None) -> None:
        self.keys = self.keys.index_select(0, rows)
        self.values = self.values.index_select(0, rows)
        if prompts is not None:
            self.prompt_keys_t = self.prompt_keys_t.index_select(0, prompts)
            self.prompt_values = self.prompt_values.index_select(0, prompts)


class SharedPrefixKVCache(Cache):
    """A decode cache whose prompt part is stored once per prompt (see the module docstring)."""

    def __init__(self, prefill: BucketedKVCache, prompt_mask: Tensor, repeats: int, capacity: int) -> None:
        """From a prefilled cache of P prompts (``prompt_mask`` [P, Lp], left padding False) with room for
        ``capacity`` completion tokens in each of ``P × repeats`` rows (row ``i*repeats + g`` is prompt i's)."""
        if capacity < 1:
            raise ConfigError(f"completion capacity must be >= 1, got {capacity}")
        length = prefill.length
        if prompt_mask.shape[1] != length:
            raise ConfigError(f"prompt mask has {prompt_mask.shape[1]} columns, the prefilled cache {length}")
        prompts = prompt_mask.shape[0]
        layers = []
        for layer in prefill.layers:
            if not layer.is_initialized:
                raise RuntimeError("SharedPrefixKVCache needs a prefilled cache (run a forward pass first)")
            layers.append(SharedPrefixLayer(layer.keys[:, :, :length], layer.values[:, :, :length],
                                            prompts * repeats, capacity))
        super().__init__(layers=layers)
        self.capacity = capacity
        self._prompt_valid = prompt_mask.to(torch.bool)
        self._set_layout([p for p in range(prompts) for _ in range(repeats)])
        self._updates = self._attends = 0  # a decoder that bypasses attend() would see only completions

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store a layer's new keys/values; raises if the previous step's attention did not go through
        :meth:`attend` (a decoder with its own attention code would attend to the completion part only)."""
        if layer_idx == 0 and self._attends != self._updates:
            raise RuntimeError(
                f"the model's attention layers ran {self._attends} shared-prefix attention calls for "
                f"{self._updates} cache updates: this decoder computes attention itself, which would miss the "
                "prompt; decode it with the plain KV cache (SamplingParams(shared_prefix=False), config "
                "shared_prefix_decode: false)")
        self._updates += 1
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _set_layout(self, row_prompt: list[int]) -> None:
        self.layout = _RowLayout(row_prompt, self._prompt_valid)

    @property
    def length(self) -> int:
        """Completion columns filled (identical across layers after a complete forward)."""
        return self.layers[0].length

    def view_length(self, length: int) -> int:
        """Columns of the engine's attention mask for ``length`` positions (the mask is not read)."""
        return length

    @property
    def recurrent_layers(self) -> list:
        """None: only attention-only decoders share a prefix (:func:`supports_shared_prefix`)."""
        return []

    def select_rows(self, indices: Tensor) -> None:
        """Keep only the decode rows ``indices`` (compaction); prompts left without rows are dropped."""
        row_prompt = self.layout.row_prompt.index_select(0, indices.to(self.layout.row_prompt.device)).tolist()
        live = sorted(set(row_prompt))
        dropped = len(live) < self.layout.num_prompts
        prompts = torch.tensor(live, dtype=torch.long, device=self._prompt_valid.device) if dropped else None
        for layer in self.layers:
            layer.select(indices.to(layer.keys.device), prompts)
        if dropped:
            renumber = {p: i for i, p in enumerate(live)}
            row_prompt = [renumber[p] for p in row_prompt]
            self._prompt_valid = self._prompt_valid.index_select(0, prompts)
        self._set_layout(row_prompt)

    def decoding(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around the decode steps: ``model``'s attention reads this cache (:func:`shared_prefix_decoding`)."""
        return shared_prefix_decoding(model, self)

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers (prompt and completion parts)."""
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (layer.prompt_keys_t, layer.prompt_values, layer.keys, layer.values))

    def attend(self, layer_idx: int, query: Tensor, keys: Tensor, values: Tensor, scaling: float) -> Tensor:
        """Attention output [B, 1, heads, D] of single-token ``query`` [B, heads, 1, D] over the row's prompt
        (this cache's prompt part) and its completion (``keys``/``values`` [B, kv_heads, Lc, D])."""
        self._attends += 1
        layer, layout = self.layers[layer_idx], self.layout
        rows, heads, _, dim = query.shape
        kv_heads = keys.shape[1]
        rep = heads // kv_heads
        prompts, width, lp = layout.num_prompts, layout.width, layer.prompt_keys_t.shape[-1]
        q = query.to(keys.dtype).reshape(rows, kv_heads, rep, dim)  # query head h reads key/value head h // rep

        # Prompt part: the rows of prompt p become width × rep query rows against p's keys, read once.
        grouped = q if layout.identity else q.new_zeros((prompts * width, kv_heads, rep, dim)).index_copy_(
            0, layout.slots, q)
        grouped = grouped.view(prompts, width, kv_heads, rep, dim).transpose(1, 2).reshape(
            prompts, kv_heads, width * rep, dim)
        prompt_scores = torch.matmul(grouped, layer.prompt_keys_t)
        prompt_scores = prompt_scores.view(prompts, kv_heads, width, rep, lp).transpose(1, 2).reshape(
            prompts * width, kv_heads, rep, lp)
        if not layout.identity:
            prompt_scores = prompt_scores.index_select(0, layout.slots)
        completion_scores = torch.matmul(q, keys.transpose(-1, -2))  # [B, kv_heads, rep, Lc]

        scores = torch.cat([prompt_scores, completion_scores], dim=-1).float() * scaling
        scores[..., :lp] += layout.bias
        probs = torch.softmax(scores, dim=-1).to(values.dtype)  # float32 scores for float32 and half caches
        prompt_probs, completion_probs = probs[..., :lp], probs[..., lp:]

        out = torch.matmul(completion_probs, values)  # [B, kv_heads, rep, D]
        if not layout.identity:
            prompt_probs = prompt_probs.new_zeros((prompts * width, kv_heads, rep, lp)).index_copy_(
                0, layout.slots, prompt_probs)
        prompt_probs = prompt_probs.reshape(prompts, width, kv_heads, rep, lp).transpose(1, 2).reshape(
            prompts, kv_heads, width * rep, lp)
        prompt_out = torch.matmul(prompt_probs, layer.prompt_values)  # [P, kv_heads, width × rep, D]
        prompt_out = prompt_out.view(prompts, kv_heads, width, rep, dim).transpose(1, 2).reshape(
            prompts * width, kv_heads, rep, dim)
        out += prompt_out if layout.identity else prompt_out.index_select(0, layout.slots)
        return out.view(rows, 1, heads, dim).to(query.dtype)


def shared_prefix_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention-interface entry: the active :class:`SharedPrefixKVCache` computes it."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError(f"attention implementation {IMPLEMENTATION!r} is only valid inside shared_prefix_decoding()")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise RuntimeError(f"shared-prefix attention does not implement {name}={kwargs[name]!r}; "
                               "this model needs the plain KV cache (SamplingParams(shared_prefix=False))")
    if dropout:
        raise RuntimeError(f"shared-prefix attention is for inference, got dropout={dropout}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    with torch.autocast(query.device.type, enabled=False):  # the cache's dtype decides (float32 for half)
        return cache.attend(module.layer_idx, query, key, value, scale), None


def _register() -> None:
    """Make :data:`IMPLEMENTATION` a transformers attention implementation (it needs no masks)."""
    register(IMPLEMENTATION, shared_prefix_attention)


def supports_shared_prefix(model: nn.Module) -> bool:
    """Whether ``model``'s attention is plain causal softmax attention that the shared prefix reproduces:
    an sdpa/eager implementation, every layer full attention, no soft-capping, no attention sinks (the layers
    are read from the text decoder's config: a vision-language model's own config names none)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in PLAIN_IMPLEMENTATIONS:
        return False
    config = text_decoder_config(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return False
    if layer_types is None and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    if any(getattr(config, name, None) for name in ("attn_logit_softcapping", "final_logit_softcapping")):
        return False
    attention = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    return bool(attention) and all(isinstance(getattr(m, "layer_idx", None), int) and not hasattr(m, "sinks")
                                   for m in attention)


@contextlib.contextmanager
def shared_prefix_decoding(model: nn.Module, cache: SharedPrefixKVCache) -> Iterator[None]:
    """Inside the block ``model``'s attention layers run :func:`shared_prefix_attention` over ``cache``."""
    _register()
    token = _ACTIVE.set(cache)
    try:
        with attention_implementation(model.config, IMPLEMENTATION):
            yield
    finally:
        _ACTIVE.reset(token)

