"""The built-in engine's decode state: sample, compact, step; shared by single- and multi-turn rollouts.

A :class:`DecodeBatch` is what :meth:`RolloutEngine.prefill
<grpo_ascend.rollout.engine.RolloutEngine.prefill>` returns: G rows per prompt over one KV cache,
the next-token logits of every row, and the per-row state a decode loop advances — attention
mask, positions, the output row of each batch row (``row_map``), which rows are done, the tokens
seen so far (repetition penalty). A loop calls :meth:`DecodeBatch.sample` (next tokens and their
log-probs), decides which rows are done, :meth:`DecodeBatch.compact` (drop finished rows when
their number falls to a smaller power-of-two bucket), then :meth:`DecodeBatch.step` (one token
per row) or :meth:`DecodeBatch.feed` (several tokens per row, e.g. a tool response).
:class:`Completions` are the preallocated output buffers rows are written into by index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.length_buckets import round_up
from grpo_ascend.rollout.kv_cache import BucketedKVCache
from grpo_ascend.rollout.sampling import SamplingParams, next_tokens
from grpo_ascend.vision.completion_images import Placement, segment_inputs
from grpo_ascend.vision.inputs import ToolImages

#: ``forward(input_ids, attention_mask, position_ids, cache, model=None) -> last-position logits [B, V]``
Forward = Callable[..., Tensor]


def row_buckets(n: int) -> list[int]:
    """Batch sizes the decode loop may run at: n, then the powers of two below n (descending)."""
    sizes = {n}
    p = 1
    while p < n:
        sizes.add(p)
        p *= 2
    return sorted(sizes, reverse=True)


def stop_token_list(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids that end a completion under ``params``: EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
    return sorted(set(([] if params.ignore_eos else list(eos_token_ids)) + [int(t) for t in params.stop_token_ids]))


@dataclass
class PromptBatch:
    """Left-padded prompts (``ids`` [P, Lp], ``mask`` [P, Lp] bool), their token counts (host) and the position
    each prompt's first completion token takes (None: its token count; images can number otherwise)."""

    ids: Tensor
    mask: Tensor
    lengths: list[int]
    next_positions: Tensor | None = None

    def rows(self, group: int) -> tuple[Tensor, Tensor]:
        """Each prompt repeated for its ``group`` completions: (ids [P*G, Lp], mask [P*G, Lp] long)."""
        return self.ids.repeat_interleave(group, dim=0), self.mask.long().repeat_interleave(group, dim=0)


class DecodeBatch:
    """G decode rows per prompt after the prefill; see the module docstring.

    ``logits`` [P*G, V] are the rows' next-token logits; ``cache`` holds ``prompt_width`` prompt
    columns and room for ``completion_width`` more; ``decode_model`` runs one-token steps (the
    compiled model when asked), ``forward`` every step. ``image_model``: the transformers model that embeds fed
    tokens and images (a feed with tool images, vision/completion_images.py); None: the model reads no images.
    """

    def __init__(
        self, *, prompts: PromptBatch, params: SamplingParams, generator: torch.Generator | None, pad: int,
        stop_ids: list[int], cache: BucketedKVCache, logits: Tensor, completion_width: int, bucket: int,
        forward: Forward, decode_model: nn.Module | None, compact: bool = True, image_model: nn.Module | None = None,
    ) -> None:
        group = params.num_generations
        dev = logits.device
        self.prompts, self.params, self.generator, self.pad = prompts, params, generator, pad
        self.cache, self.forward, self.decode_model, self.compacting = cache, forward, decode_model, compact
        self.image_model = image_model
        self.group, self.bucket = group, bucket
        self.prompt_width, self.completion_width = prompts.ids.shape[1], completion_width
        self.n_rows = len(prompts.lengths) * group
        self.stop_list = stop_ids
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=dev) if stop_ids else None
        self.logits = logits.repeat_interleave(group, dim=0)
        starts = prompts.next_positions if prompts.next_positions is not None else torch.tensor(prompts.lengths)
        self.positions = starts.long().repeat_interleave(group).to(dev)
        self.attn = torch.zeros((self.n_rows, self.prompt_width + completion_width), dtype=torch.bool, device=dev)
        self.attn[:, : self.prompt_width] = prompts.mask.repeat_interleave(group, dim=0)
        self.seen = self._seen_prompt_tokens() if params.repetition_penalty != 1.0 else None
        self.row_map = torch.arange(self.n_rows, device=dev)  # decode-batch row -> output row
        self.done = torch.zeros(self.n_rows, dtype=torch.bool, device=dev)
        self.tokens = torch.full((self.n_rows,), pad, dtype=torch.long, device=dev)
        self.buckets = row_buckets(self.n_rows)
        self.batch_sizes = [self.n_rows]
        self.col = self.prompt_width  # the cache column the next token goes to

    def _seen_prompt_tokens(self) -> Tensor:
        ids, mask = self.prompts.ids, self.prompts.mask
        vocab = self.logits.shape[-1]
        seen = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.bool, device=ids.device)
        seen.scatter_(1, ids.masked_fill(~mask, vocab), True)
        return seen[:, :vocab].repeat_interleave(self.group, dim=0)

    @property
    def size(self) -> int:
        """Rows in the decode batch now (after compactions)."""
        return self.tokens.shape[0]

    def sample(self) -> tuple[Tensor, Tensor]:
        """The next token of every row (pad on done rows) and its log-prob; remembered for :meth:`step`."""
        tokens, lps = next_tokens(self.logits, self.params, self.seen, self.generator)
        tokens = tokens.masked_fill(self.done, self.pad)
        if self.seen is not None:
            self.seen.scatter_(1, tokens.unsqueeze(1), True)
        self.tokens = tokens
        return tokens, lps

    def stopped(self, tokens: Tensor) -> Tensor | None:
        """Rows whose ``tokens`` are a stop id ([B] bool), None when nothing stops a row."""
        if self.stop_ids is None:
            return None
        return (tokens.unsqueeze(1) == self.stop_ids).any(dim=1)

    def mark_seen(self, batch_row: int, token_ids: Sequence[int]) -> None:
        """Count appended tokens as seen by ``batch_row`` (repetition penalty)."""
        if self.seen is not None:
            self.seen[batch_row, torch.tensor(list(token_ids), device=self.seen.device)] = True

    def compact(self, n_alive: int) -> Tensor | None:
        """Drop done rows when ``n_alive`` fits a smaller batch bucket; the kept batch rows, else None."""
        target = min(b for b in self.buckets if b >= n_alive)
        if not self.compacting or target >= self.size:
            return None
        keep = torch.argsort(self.done.to(torch.int32), stable=True)[:target]  # running rows first
        self.cache.select_rows(keep)
        self.row_map, self.tokens, self.positions, self.attn, self.done = (
            self.row_map[keep], self.tokens[keep], self.positions[keep], self.attn[keep], self.done[keep]
        )
        if self.seen is not None:
            self.seen = self.seen[keep]
        self.batch_sizes.append(target)
        return keep

    def step(self) -> None:
        """Feed every row its sampled token; the next logits."""
        self.attn[:, self.col] = True
        view = self.cache.view_length(self.col + 1)
        self.logits = self.forward(
            self.tokens.unsqueeze(1), self.attn[:, :view], self.positions.unsqueeze(1), self.cache, self.decode_model
        )
        self.positions = self.positions + 1
        self.col += 1

    def feed(self, feeds: Sequence[Sequence[int]], images: Sequence[ToolImages | None] | None = None) -> None:
        """Feed each row its tokens (left-padded to the longest; the cache grows when they outrun it).

        ``images``: per batch row, the tool images among its fed tokens (columns counted from its first fed
        token), or None. Their features go at those tokens and a multimodal-rotary model numbers them over their
        grid (vision/completion_images.py); the row's next position then moves by that numbering's span.
        """
        width = max(len(f) for f in feeds)
        if self.col + width > self.cache.capacity:
            self._grow(round_up(self.col + width + self.params.max_completion_length, self.bucket))
        placements = [Placement(i, tuple(width - len(feeds[i]) + c for c in t.columns), t.per_image)
                      for i, t in enumerate(images or ()) if t is not None and t.num_images > 0]
        if width == 1 and not placements:
            self.step()
            return
        dev = self.attn.device
        n_fed = torch.tensor([len(f) for f in feeds], device=dev)
        step_ids = torch.tensor([[self.pad] * (width - len(f)) + list(f) for f in feeds], device=dev)
        offsets = torch.arange(width, device=dev).unsqueeze(0) - (width - n_fed).unsqueeze(1)
        real = offsets >= 0
        self.attn[:, self.col : self.col + width] = real
        if placements:
            self._feed_images(step_ids, real, placements)
            return
        step_pos = self.positions.unsqueeze(1) + offsets.clamp_min(0)
        self.positions = self.positions + n_fed
        if self.cache.recurrent_layers:
            self._feed_by_column(step_ids, real, step_pos)
            return
        view = self.cache.view_length(self.col + width)
        self.logits = self.forward(step_ids, self.attn[:, :view], step_pos, self.cache)
        self.col += width

    def _feed_images(self, step_ids: Tensor, real: Tensor, placements: list[Placement]) -> None:
        """A feed holding tool images: one forward over their embeddings and positions (see :meth:`feed`)."""
        if self.image_model is None or self.cache.recurrent_layers:
            raise ConfigError("tool images can be fed only to a vision-language model with attention layers only; "
                              "return text from the tool for this model")
        embeds, step_pos, spans = segment_inputs(self.image_model, step_ids, real, self.positions, placements)
        self.positions = self.positions + spans.to(self.positions.device)
        view = self.cache.view_length(self.col + step_ids.shape[1])
        self.logits = self.forward(step_ids, self.attn[:, :view], step_pos, self.cache, embeds=embeds)
        self.col += step_ids.shape[1]

    def _feed_by_column(self, step_ids: Tensor, real: Tensor, step_pos: Tensor) -> None:
        """A hybrid decoder's feed, one column per forward: a padding column would advance a row's recurrent state
        (attention masks it out, a scan does not), so the rows it pads keep their state across that forward."""
        for j in range(step_ids.shape[1]):
            padded = ~real[:, j]
            view = self.cache.view_length(self.col + 1)
            with self.cache.holding_rows(padded):
                self.logits = self.forward(step_ids[:, j : j + 1], self.attn[:, :view], step_pos[:, j : j + 1],
                                           self.cache)
            self.col += 1

    def _grow(self, capacity: int) -> None:
        self.cache.grow(capacity)
        grown = self.attn.new_zeros((self.attn.shape[0], capacity))
        grown[:, : self.attn.shape[1]] = self.attn
        self.attn = grown

    def release(self) -> None:
        """Drop the cache and logits (the decode is over)."""
        del self.cache, self.logits


class Completions:
    """Preallocated output buffers [N, W]: token ids (pad), sampling log-probs (0) and a bool mask."""

    def __init__(self, rows: int, width: int, pad: int, device: torch.device) -> None:
        self.ids = torch.full((rows, width), pad, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((rows, width), dtype=torch.float32, device=device)
        self.mask = torch.zeros((rows, width), dtype=torch.bool, device=device)

    def trim(self, lengths: Sequence[int], bucket: int) -> int:
        """Cut the buffers to the bucketed width of the longest row; that width."""
        full = self.ids.shape[1]
        width = min(full, round_up(max(lengths), bucket))
        if width < full:
            self.ids, self.logprobs, self.mask = (x[:, :width].contiguous() for x in (self.ids, self.logprobs, self.mask))
        return width
