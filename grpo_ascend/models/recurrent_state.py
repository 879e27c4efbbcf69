"""The cache layer of a linear-attention or Mamba2 decoder layer: each row's convolution window and recurrent state.

Such a layer (Qwen3-Next's and Qwen3.5's gated DeltaNet, NemotronH's Mamba2 mixer) keeps no keys and
values per token but two fixed-size tensors per row: the last ``kernel`` inputs of its causal
convolution (``conv_states``, ``[rows, channels, kernel]``) and the recurrent state the scan carries
(``recurrent_states``: ``[rows, heads, key_dim, value_dim]`` for DeltaNet, ``[rows, heads, head_dim,
state_size]`` for Mamba2). :class:`RecurrentStateLayer` speaks transformers' linear-attention cache-layer
protocol (the decoder layers call ``get_conv_state`` / ``update_conv_state`` / ``get_recurrent_state`` /
``update_recurrent_state`` on the cache, which forwards them here) and adds the row operations grouped
sampling and the shared-prompt log-prob forward need: copies for a prompt's G completions
(:meth:`RecurrentStateLayer.repeated`), keeping rows (:meth:`RecurrentStateLayer.select_rows`), and putting
back the state of rows a forward must not advance (:meth:`RecurrentStateLayer.snapshot` /
:meth:`RecurrentStateLayer.restore_rows`).

States are replaced, never written in place: the log-prob forward differentiates through the state a
prompt's prefill left (its backward needs that tensor unchanged). Left padding of a prompt does not reach
the state: the decoder zeroes padded positions' inputs (transformers' recurrent padding mask), and a zero
input leaves a zero state at zero. :func:`prompt_cache` builds the log-prob forward's cache of a decoder.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import cache_utils
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from grpo_ascend.models.layer_kinds import ATTENTION, RECURRENT, layer_kinds, text_decoder_config

#: transformers' cache layers of hybrid decoders (5.25 tested; older 5.x lack one or both, and
#: :func:`~grpo_ascend.models.layer_kinds.layer_kinds` then refuses hybrids with the version to install).
DummyLayer: Any = getattr(cache_utils, "DummyLayer", None)
LinearAttentionCacheLayerMixin: Any = getattr(cache_utils, "LinearAttentionCacheLayerMixin", object)

#: A snapshot of one layer's states: (conv states, recurrent states), each by state index.
Snapshot = tuple[dict[int, Tensor | None], dict[int, Tensor | None]]


class RecurrentStateLayer(LinearAttentionCacheLayerMixin):
    """One recurrent decoder layer's per-row convolution window and recurrent state (see the module docstring)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, number_of_states: int = 1) -> None:
        super().__init__(number_of_states=number_of_states)
        self.length = 0  # positions this layer has seen per row (the mask's column count, padding included)

    # ------------------------------------------------------------------ transformers' protocol

    def lazy_initialization(self, conv_states: Tensor | None = None, recurrent_states: Tensor | None = None,
                            state_idx: int = 0, conv_kernel_size: int | None = None) -> None:
        """Record the device, dtype and convolution width from the first states the layer is given."""
        first = conv_states if conv_states is not None else recurrent_states
        if isinstance(first, Tensor) and self.device is None:
            self.device, self.dtype = first.device, first.dtype
        if conv_states is not None:
            self.conv_kernel_size[state_idx] = conv_kernel_size or conv_states.shape[-1]
            self.is_conv_states_initialized[state_idx] = True
        if recurrent_states is not None:
            self.is_recurrent_states_initialized[state_idx] = True

    def update_conv_state(self, conv_states: Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs: Any) -> Tensor:
        """Keep the last ``kernel`` inputs of ``conv_states`` ``[rows, channels, new]``; return what the convolution
        reads: the new inputs after the kept window of the previous forward (just the new ones on a first forward)."""
        if not self.is_conv_states_initialized[state_idx]:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size)
        kernel = self.conv_kernel_size[state_idx]
        if state_idx == 0:
            self.length += conv_states.shape[-1]
        previous = self.conv_states[state_idx] if self.has_previous_state[state_idx] else None
        full = conv_states if previous is None else torch.cat([previous, conv_states], dim=-1)
        window = full[..., -kernel:]
        if window.shape[-1] < kernel:
            window = torch.nn.functional.pad(window, (kernel - window.shape[-1], 0))
        self.conv_states[state_idx] = window.clone(memory_format=torch.contiguous_format)
        self.has_previous_state[state_idx] = True
        return full

    def update_recurrent_state(self, recurrent_states: Tensor | list[Tensor], state_idx: int = 0,
                               **kwargs: Any) -> Tensor:
        """Replace the recurrent state (the last one when given a forward's sequence of states)."""
        state = recurrent_states if isinstance(recurrent_states, Tensor) else recurrent_states[-1]
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=state, state_idx=state_idx)
        self.recurrent_states[state_idx] = state
        return state

    def increase_count(self, state_idx: int) -> None:
        """One more position (a single-token step updates the convolution window in place, not through the cache)."""
        if state_idx == 0:
            self.length += 1

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        """Forget every state (the next forward starts from zero)."""
        for i in range(self.number_of_states):
            self.conv_states[i] = self.recurrent_states[i] = None
            self.has_previous_state[i] = False
        self.length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    # ------------------------------------------------------------------ row operations

    def select_rows(self, rows: Tensor) -> None:
        """Keep (or gather) the rows ``rows`` of every state; a gather, so gradients flow back to the source rows."""
        self._map(lambda t: t.index_select(0, rows.to(t.device)))

    def repeated(self, repeats: int) -> RecurrentStateLayer:
        """A new layer whose row ``i * repeats + g`` holds this layer's row ``i`` (a prompt's state for its G rows)."""
        out = RecurrentStateLayer(self.number_of_states)
        out.length, out.device, out.dtype = self.length, self.device, self.dtype
        for i in range(self.number_of_states):
            out.conv_kernel_size[i] = self.conv_kernel_size[i]
            out.has_previous_state[i] = self.has_previous_state[i]
            out.is_conv_states_initialized[i] = self.is_conv_states_initialized[i]
            out.is_recurrent_states_initialized[i] = self.is_recurrent_states_initialized[i]
            for mine, theirs in ((self.conv_states, out.conv_states), (self.recurrent_states, out.recurrent_states)):
                theirs[i] = None if mine[i] is None else mine[i].repeat_interleave(repeats, dim=0)
        return out

    def snapshot(self) -> Snapshot:
        """Copies of the current states (a single-token step updates the convolution window in place)."""
        def copy(states: dict[int, Tensor | None]) -> dict[int, Tensor | None]:
            return {i: None if t is None else t.clone() for i, t in states.items()}

        return copy(self.conv_states), copy(self.recurrent_states)

    def restore_rows(self, rows: Tensor, snapshot: Snapshot) -> None:
        """Put back the ``snapshot``'s states of the rows where ``rows`` ([rows] bool) is True."""
        for now, then in ((self.conv_states, snapshot[0]), (self.recurrent_states, snapshot[1])):
            for i, old in then.items():
                if old is not None and now[i] is not None:
                    keep = rows.to(old.device).view(-1, *([1] * (old.dim() - 1)))
                    now[i] = torch.where(keep, old, now[i])

    def state_tensors(self) -> list[Tensor]:
        """Every state tensor the layer holds."""
        return [t for states in (self.conv_states, self.recurrent_states) for t in states.values() if t is not None]

    def nbytes(self) -> int:
        """Bytes of the states held."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    def _map(self, fn: Any) -> None:
        for states in (self.conv_states, self.recurrent_states):
            for i, t in states.items():
                if t is not None:
                    states[i] = fn(t)


def prompt_cache(config: Any) -> Cache:
    """The log-prob forward's cache for a prompt prefill: transformers' dynamic cache for an attention-only decoder;
    for a hybrid one, dynamic key/value layers beside :class:`RecurrentStateLayer` s (whose states a backward can
    differentiate through, see the module docstring)."""
    kinds = layer_kinds(config)
    if RECURRENT not in kinds:
        return DynamicCache(config=config)
    return Cache(layers=[DynamicLayer() if kind == ATTENTION else recurrent_layer(config) if kind == RECURRENT
                         else DummyLayer() for kind in kinds])


def states_per_layer(config: Any) -> int:
    """How many convolution (and recurrent) states each recurrent layer of a decoder of ``config`` keeps."""
    return int(getattr(text_decoder_config(config), "number_of_conv_states", 1) or 1)


def recurrent_layer(config: Any) -> RecurrentStateLayer:
    """An empty :class:`RecurrentStateLayer` for a decoder of ``config``."""
    return RecurrentStateLayer(states_per_layer(config))
