"""Preallocated, length-bucketed KV cache for the rollout engine.

Each layer owns one buffer ``[batch, kv_heads, capacity, head_dim]`` allocated once, written in
place at a host-side position (a plain int shared by all rows: every row advances one column per
decode step), and read back as a view of the first ``round_up(length, bucket)`` columns. The
model therefore sees only a handful of key/value lengths per rollout (one per bucket) instead of
one per step, which is what a shape-compiling backend (Ascend graph mode) needs, and attention
does not pay for the whole capacity at every step. Columns of the view that are not written yet
are excluded by the attention mask the engine passes, so their contents never matter.

Two batch operations serve grouped sampling: :meth:`BucketedKVCache.expand_into` copies a
prefilled cache of P prompts into a new cache of P·G rows (row ``i*G + g`` holds prompt ``i``),
and :meth:`BucketedKVCache.select_rows` keeps a subset of rows (compaction of finished rows). A hybrid
decoder's recurrent layers (linear attention, Mamba2) keep each row's state in the same cache and follow
the same operations (:mod:`grpo_ascend.models.recurrent_state`).

The class plugs into transformers' ``Cache`` protocol (``update``, ``get_seq_length``,
``get_mask_sizes``), so any decoder that accepts a ``Cache`` (including PEFT-wrapped ones) uses it
unchanged. It reports itself as compileable so that the mask builder never drops the mask at
decode time (the view may contain unwritten columns).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # transformers < 5: no per-layer cache API
    raise ImportError(
        "grpo_ascend's rollout engine needs transformers >= 5 (the per-layer Cache API); "
        "upgrade with `pip install -U 'transformers>=5'`"
    ) from exc

from grpo_ascend.errors import ConfigError
from grpo_ascend.length_buckets import round_up
from grpo_ascend.models.layer_kinds import ATTENTION, RECURRENT
from grpo_ascend.models.recurrent_state import DummyLayer, RecurrentStateLayer


class BucketedLayer(CacheLayerMixin):
    """One attention layer's preallocated key/value buffers with a bucketed read view."""

    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, capacity: int, bucket: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.bucket = bucket
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Allocate the buffers from the first update's batch, heads, head dims, dtype and device."""
        batch, heads = key_states.shape[:2]
        self.device = key_states.device
        self.keys = key_states.new_zeros((batch, heads, self.capacity, key_states.shape[-1]))
        self.values = value_states.new_zeros(
            (batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        )
        self.is_initialized = True

    def view_length(self, length: int) -> int:
        """Columns exposed to attention when ``length`` columns are filled."""
        return min(round_up(length, self.bucket), self.capacity)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write the new states at the current position and return the bucketed view of the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, n = self.length, key_states.shape[-2]
        if start + n > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: writing {n} positions at {start} exceeds capacity {self.capacity}"
            )
        self.keys[:, :, start : start + n].copy_(key_states)
        self.values[:, :, start : start + n].copy_(value_states)
        self.length = start + n
        view = self.view_length(self.length)
        return self.keys[:, :, :view], self.values[:, :, :view]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the view the next update with ``query_length`` tokens returns."""
        return self.view_length(self.length + query_length), 0

    def get_seq_length(self) -> int:
        """Number of filled columns."""
        return self.length

    def get_max_length(self) -> int:
        """The preallocated capacity."""
        return self.capacity

    def reset(self) -> None:
        """Forget the contents (buffers are kept and overwritten by the next updates)."""
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' negative-count convention)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop expects a negative count of positions to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder (or select) rows along the batch dimension."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times contiguously."""
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep only the rows ``indices`` (a new, smaller buffer; the old one is freed)."""
        if self.is_initialized:
            indices = indices.to(self.keys.device)
            self.keys = self.keys.index_select(0, indices)
            self.values = self.values.index_select(0, indices)


class BucketedKVCache(Cache):
    """A ``Cache`` of :class:`BucketedLayer` s, one per attention layer, with shared capacity and bucket.

    A hybrid decoder's recurrent layers (``layer_kinds``, from :func:`grpo_ascend.models.layer_kinds.layer_kinds`)
    hold a :class:`~grpo_ascend.models.recurrent_state.RecurrentStateLayer` each (a row's convolution window and
    recurrent state), which follows the rows through :meth:`expand_into` and :meth:`select_rows` like the keys
    and values; layers that keep nothing (MoE / MLP blocks) hold transformers' ``DummyLayer``.
    """

    def __init__(self, num_layers: int, capacity: int, bucket: int = 64, layer_kinds: Sequence[str] | None = None,
                 recurrent_states: int = 1) -> None:
        if num_layers < 1:
            raise ConfigError(f"a KV cache needs at least one layer, got num_layers={num_layers}")
        if capacity < 1:
            raise ConfigError(f"KV cache capacity must be >= 1, got {capacity}")
        kinds = list(layer_kinds) if layer_kinds is not None else [ATTENTION] * num_layers
        if len(kinds) != num_layers or ATTENTION not in kinds:
            raise ConfigError(f"layer_kinds {kinds} must name {num_layers} layers, at least one of them {ATTENTION!r}")
        super().__init__(layers=[BucketedLayer(capacity, bucket) if kind == ATTENTION
                                 else RecurrentStateLayer(recurrent_states) if kind == RECURRENT else DummyLayer()
                                 for kind in kinds])
        self.capacity = capacity
        self.bucket = bucket
        self.layer_kinds = kinds
        self.recurrent_states = recurrent_states
        self._first_attention = kinds.index(ATTENTION)

    @property
    def attention_layers(self) -> list[BucketedLayer]:
        """The layers holding keys and values."""
        return [layer for layer in self.layers if isinstance(layer, BucketedLayer)]

    @property
    def recurrent_layers(self) -> list[RecurrentStateLayer]:
        """The layers holding a recurrent state per row (none in an attention-only decoder)."""
        return [layer for layer in self.layers if isinstance(layer, RecurrentStateLayer)]

    @property
    def length(self) -> int:
        """Filled columns (identical across layers after a complete forward)."""
        return self.layers[self._first_attention].length

    def view_length(self, length: int) -> int:
        """Columns of the attention mask a forward reads when ``length`` columns are filled."""
        return self.layers[self._first_attention].view_length(length)

    def expand_into(self, repeats: int, capacity: int) -> BucketedKVCache:
        """A new cache of ``rows * repeats`` rows and ``capacity`` columns holding this cache's contents.

        Row ``i * repeats + g`` is a copy of row ``i``: the prompt is prefilled once and shared by
        its ``repeats`` completions (its recurrent states too). The copy broadcasts straight into the
        new buffer (no intermediate repeated tensor).
        """
        if capacity < self.length:
            raise ConfigError(f"expanded capacity {capacity} is smaller than the filled length {self.length}")
        out = BucketedKVCache(len(self.layers), capacity, self.bucket, self.layer_kinds, self.recurrent_states)
        for i, src in enumerate(self.layers):
            if isinstance(src, RecurrentStateLayer):
                out.layers[i] = src.repeated(repeats)
                continue
            if not isinstance(src, BucketedLayer):
                continue
            dst = out.layers[i]
            if not src.is_initialized:
                raise RuntimeError("expand_into needs a prefilled cache (run a forward pass first)")
            rows, length = src.keys.shape[0], src.length
            for name in ("keys", "values"):
                s = getattr(src, name)
                buf = s.new_zeros((rows * repeats, s.shape[1], capacity, s.shape[-1]))
                buf.view(rows, repeats, s.shape[1], capacity, s.shape[-1])[:, :, :, :length].copy_(
                    s[:, None, :, :length]
                )
                setattr(dst, name, buf)
            dst.device = src.keys.device
            dst.length = length
            dst.is_initialized = True
        return out

    def select_rows(self, indices: Tensor) -> None:
        """Keep only the rows ``indices`` (compaction of finished sequences)."""
        self.batch_select_indices(indices)

    def grow(self, capacity: int) -> None:
        """Reallocate every attention layer to ``capacity`` columns, keeping the filled ones (a copy)."""
        for layer in self.attention_layers:
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[-1]))
                new[:, :, : layer.length].copy_(old[:, :, : layer.length])
                setattr(layer, name, new)
            layer.capacity = capacity
        self.capacity = capacity

    @contextlib.contextmanager
    def holding_rows(self, rows: Tensor) -> Iterator[None]:
        """Inside the block forwards leave the recurrent states of ``rows`` ([batch] bool) as they were at its start
        (their keys/values are written but masked out by the caller); nothing to do without recurrent layers."""
        layers = self.recurrent_layers
        snapshots = [layer.snapshot() for layer in layers]
        yield
        for layer, snapshot in zip(layers, snapshots):
            layer.restore_rows(rows, snapshot)

    def decoding(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around the decode steps: nothing to switch (the model's own attention reads this cache)."""
        return contextlib.nullcontext()

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers and the recurrent states."""
        return sum(
            layer.keys.numel() * layer.keys.element_size()
            + layer.values.numel() * layer.values.element_size()
            for layer in self.attention_layers
            if layer.is_initialized
        ) + sum(layer.nbytes() for layer in self.recurrent_layers)
