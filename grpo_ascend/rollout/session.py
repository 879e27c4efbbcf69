"""The built-in engine's :class:`~grpo_ascend.rollout.backend.RolloutSession`: contexts continued until a stop.

One prefill per prompt, the cache copied to its G rows (never re-prefilled), one decode step per
token; :meth:`BuiltinSession.advance` returns at the first step where any row ends its turn (a
stop id, or the length limit), so the caller's tool calls run as soon as a turn ends. Tokens a
caller appends are fed with the next step: that step's input is, per row, every completion token
not yet in the cache (one sampled token, or the turn's stop token plus the appended ones),
left-padded to the longest. Padding columns are masked out of attention and positions come from
each row's own count, so a row's keys/values and logits are exactly those of the whole
conversation run from scratch; only the appended tokens are computed. The host reads the rows
every step (it must see turn ends anyway); finished rows are compacted away as in single-turn
decoding.

Tool images: a row appended with images (:class:`~grpo_ascend.vision.inputs.ToolImages`, columns from the
appended tokens' start) feeds them at its next step, the features at their tokens and their positions numbered as
the model numbers images (:meth:`~grpo_ascend.rollout.decoding.DecodeBatch.feed`), on the same cache: a row is
never re-prefilled, since the segment's keys and values are exactly those of the whole conversation run at once
(vision/completion_images.py). The rows' tool images come out in :attr:`SessionOutput.tool_images`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch

from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.backend import RolloutSession, SessionOutput, TurnEnd
from grpo_ascend.rollout.decoding import Completions, DecodeBatch
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.vision.inputs import PromptImages, ToolImages


class Prefiller(Protocol):
    """What a session needs from the rollout engine that starts it (:class:`~grpo_ascend.rollout.engine.RolloutEngine`)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def pad_token_id(self) -> int: ...

    def evaluating(self) -> contextlib.AbstractContextManager[None]: ...

    def prefill(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                generator: torch.Generator | None = None, *, shared_prefix: bool = True,
                images: Sequence[PromptImages | None] | None = None) -> DecodeBatch: ...


class BuiltinSession(RolloutSession):
    """A session over :meth:`Prefiller.prefill`'s decode state; see the module docstring."""

    def __init__(
        self, engine: Prefiller, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
        generator: torch.Generator | None, images: Sequence[PromptImages | None] | None = None,
    ) -> None:
        if params.stop_strings:
            raise ConfigError("a rollout session stops at token ids only (EOS, stop_token_ids); "
                              f"remove stop_strings {list(params.stop_strings)} or use stop_token_ids")
        self._mode = contextlib.ExitStack()
        self._mode.enter_context(engine.evaluating())
        try:
            with torch.no_grad():
                self.batch = engine.prefill(prompt_ids, params, generator, shared_prefix=False, images=images)
        except BaseException:
            self._mode.close()
            raise
        n, dev = self.batch.n_rows, engine.device
        self.max_new, self.pad = params.max_completion_length, engine.pad_token_id
        self.out = Completions(n, self.batch.completion_width, self.pad, dev)  # mask: sampled by the policy
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)  # completion tokens written, per output row
        self.host_pos = [0] * n
        self.turn_start = [0] * n  # where each row's current turn starts
        self.feed: list[list[int]] = [[] for _ in range(n)]  # tokens each row feeds at the next step
        self.feed_images: dict[int, ToolImages] = {}  # output row -> tool images in its feed (feed columns)
        self.tool_images: list[ToolImages | None] = [None] * n  # each row's tool images (completion columns)
        self.host_map = list(range(n))  # decode-batch row -> output row, on the host
        self.host_alive: list[bool] = []  # batch rows running at the last sample
        self.paused: dict[int, int] = {}  # output row -> batch row, returned by the last advance
        self.resumed: set[int] = set()  # paused rows appended to since
        self.steps = 0
        self.started = self.over = False

    @torch.no_grad()
    def advance(self) -> list[TurnEnd]:
        """Decode until some rows end their turn; those rows (empty when none is running)."""
        if self.over or (self.started and not self._resume()):
            return []
        self.started = True
        while True:
            ends = self._sample()
            if ends:
                return ends
            if not self._resume():
                return []

    def append_with_images(self, row: int, token_ids: Sequence[int], images: ToolImages) -> None:
        """As :meth:`append`, ``images`` being the tool images among the tokens (see the module docstring)."""
        self.append(row, token_ids, images)

    def append(self, row: int, token_ids: Sequence[int], images: ToolImages | None = None) -> None:
        """Add ``token_ids`` to paused ``row`` (log-prob 0, not generated); it continues at the next advance."""
        if row not in self.paused or row in self.resumed:
            raise ConfigError(f"row {row} is not paused: append to rows the last advance() returned, once each")
        pos, n = self.host_pos[row], len(token_ids)
        if pos + n >= self.max_new:
            raise ConfigError(f"appending {n} tokens to row {row} at {pos} leaves no room under "
                              f"max_completion_length={self.max_new}")
        dev = self.out.ids.device
        self.out.ids[row, pos : pos + n] = torch.tensor(list(token_ids), device=dev)
        self.out.logprobs[row, pos : pos + n] = 0.0
        self.host_pos[row] = self.turn_start[row] = pos + n
        self.pos[row] = pos + n
        if images is not None and images.num_images:
            fed = len(self.feed[row])
            self.feed_images[row] = ToolImages(images.per_image, tuple(fed + c for c in images.columns), images.num_images)
            placed = ToolImages(images.per_image, tuple(pos + c for c in images.columns), images.num_images)
            held = self.tool_images[row]
            self.tool_images[row] = placed if held is None else held.then(placed)
        self.feed[row] = self.feed[row] + list(token_ids)
        self.batch.mark_seen(self.paused[row], token_ids)
        self.resumed.add(row)

    def output(self) -> SessionOutput:
        lengths = self.pos
        self.out.trim(lengths.tolist(), self.batch.bucket)
        prompt_ids, prompt_mask = self.batch.prompts.rows(self.batch.group)
        return SessionOutput(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=self.out.ids, sampling_logprobs=self.out.logprobs, generated=self.out.mask,
            lengths=lengths, steps=self.steps, decode_batch_sizes=self.batch.batch_sizes,
            tool_images=list(self.tool_images) if any(t is not None for t in self.tool_images) else [],
        )

    def close(self) -> None:
        if hasattr(self.batch, "cache"):
            self.batch.release()
        self._mode.close()

    def _sample(self) -> list[TurnEnd]:
        """One token for every running row, written at the row's own position; the rows that ended a turn."""
        b = self.batch
        tokens, lps = b.sample()
        alive = ~b.done
        where = self.pos[b.row_map]
        live_rows, live_cols = b.row_map[alive], where[alive]
        self.out.ids[live_rows, live_cols] = tokens[alive]
        self.out.logprobs[live_rows, live_cols] = lps[alive].float()
        self.out.mask[live_rows, live_cols] = True
        self.pos[live_rows] += 1
        stops = b.stopped(tokens)
        ended = alive & stops if stops is not None else alive & False
        self.steps += 1
        host_alive, host_ended = alive.tolist(), ended.tolist()
        host_tokens, host_pos = tokens.tolist(), self.pos.tolist()
        ends: list[TurnEnd] = []
        for i, r in enumerate(self.host_map):
            if not host_alive[i]:
                continue
            self.host_pos[r] = host_pos[r]
            self.feed[r] = [host_tokens[i]]
            if host_ended[i] or host_pos[r] >= self.max_new:
                turn = self.out.ids[r, self.turn_start[r] : host_pos[r]].tolist()
                ends.append(TurnEnd(row=r, tokens=turn, stopped=host_ended[i], length=host_pos[r]))
                self.paused[r] = i
        self.host_alive = host_alive
        return ends

    def _resume(self) -> bool:
        """Finish paused rows nobody appended to, compact, feed the next step; False when no row runs."""
        b = self.batch
        finished = [i for r, i in self.paused.items() if r not in self.resumed]
        self.paused, self.resumed = {}, set()
        if finished:
            b.done = b.done.clone()
            b.done[torch.tensor(finished, device=b.done.device)] = True
        n_alive = sum(self.host_alive) - len(finished)
        if n_alive == 0:
            self.over = True
            return False
        keep = b.compact(n_alive)
        if keep is not None:
            self.host_map = [self.host_map[k] for k in keep.tolist()]
        host_done = b.done.tolist()
        images = [None if host_done[i] else self.feed_images.get(r) for i, r in enumerate(self.host_map)]
        self.feed_images = {}
        b.feed([[self.pad] if host_done[i] else self.feed[r] for i, r in enumerate(self.host_map)],
               images if any(t is not None for t in images) else None)
        return True
