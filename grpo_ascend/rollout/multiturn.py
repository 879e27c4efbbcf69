"""Multi-turn rollouts with tool calls, on the engine's shared-prefill KV cache, never re-prefilled.

:class:`MultiTurnEngine` wraps a :class:`~grpo_ascend.rollout.engine.RolloutEngine` and samples
G completions per prompt the same way (one prefill per prompt, the cache copied G times, one
decode step per token, finished rows compacted away), with one addition: when a row ends an
assistant turn (EOS, the template's end of turn), the turn is parsed for tool calls. All rows that
ended a turn at the same step go through one :func:`~grpo_ascend.tools.run_tool_step` (their calls
run concurrently); a row with calls gets its tool responses and the next assistant header appended
and keeps decoding, a row without calls is finished.

The appended tokens are fed with the next decode step: that step's input is, per row, every
completion token not yet in the cache (one sampled token, or the turn's EOS plus its tool
suffix), left-padded to the longest. Padding columns are masked out of attention and positions
come from each row's own count, so a row's keys/values and logits are exactly those of the whole
conversation run from scratch; only the appended tokens are computed. The cache grows (a copy)
in the rare case the padding columns outrun its capacity.

Output: a :class:`MultiTurnBatch`, the engine's :class:`RolloutBatch` plus ``tool_mask`` (1 on
generated tokens, 0 on tool-response tokens and padding), the conversation messages per row and
tool metrics. ``completion_ids`` hold generated and tool tokens interleaved, ``completion_mask``
marks them all (the context), ``sampling_logprobs`` are 0 on tool tokens.

Limits: ``max_completion_length`` counts generated and tool tokens together (a tool response
that does not fit ends the row as truncated); ``max_tool_calling_iterations`` tool steps per row
(a turn with calls past the limit ends the row, its calls not run); tool output truncation is the
executor's ``max_output_chars``. The host checks rows every step (it must read turn ends anyway).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.device import default_length_bucket
from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.rollout.engine import Prompt, RolloutBatch, RolloutEngine, _row_buckets, _synchronize
from grpo_ascend.rollout.kv_cache import BucketedKVCache, round_up
from grpo_ascend.rollout.sampling import SamplingParams, next_tokens
from grpo_ascend.tools.execution import ToolExecutor, tool_metrics
from grpo_ascend.tools.parsing import get_tool_call_parser
from grpo_ascend.tools.toolset import Toolset
from grpo_ascend.tools.turns import run_tool_step


@dataclass
class MultiTurnBatch(RolloutBatch):
    """A :class:`RolloutBatch` whose completions may hold tool responses.

    ``tool_mask`` [N, Lc] is 1 on tokens the policy generated and 0 on tool-response tokens (and
    padding): the loss mask is ``completion_mask * tool_mask``. ``messages`` per row: the
    completion as chat messages (assistant turns with ``tool_calls``, ``tool`` messages).
    ``num_turns`` [N]: assistant turns per row. ``tool_metrics``: calls per completion, failed
    calls by reason, tool time, turns per completion, rows cut by the length limit.
    """

    tool_mask: Tensor | None = None
    messages: list[list[dict[str, Any]]] = field(default_factory=list)
    num_turns: Tensor | None = None
    tool_metrics: dict[str, float] = field(default_factory=dict)
    #: Per-row values the reward functions receive as keyword arguments (e.g. ``environments``).
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class ToolSettings:
    """What the multi-turn loop needs besides the model: tools, how calls run and are parsed, limits.

    ``max_tool_calling_iterations``: tool steps per completion (None: only the length limit).
    """

    toolset: Toolset
    executor: ToolExecutor
    parser: str = "qwen"
    max_tool_calling_iterations: int | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        get_tool_call_parser(self.parser)  # an unknown parser fails here, naming the known ones
        limit = self.max_tool_calling_iterations
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ConfigError(f"max_tool_calling_iterations must be None or an int >= 0, got {limit!r}")


@dataclass
class _Row:
    """Host bookkeeping of one output row."""

    pos: int = 0  # completion tokens written (generated + tool)
    turn_start: int = 0  # where the current assistant turn starts
    iterations: int = 0  # tool steps taken
    messages: list[dict[str, Any]] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)  # tokens to feed at the next forward


class MultiTurnEngine:
    """Multi-turn tool-calling rollouts on a :class:`RolloutEngine`; see the module docstring."""

    def __init__(self, engine: RolloutEngine, tools: ToolSettings) -> None:
        self.engine = engine
        self.tools = tools
        self.params = engine.params

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        toolsets: Sequence[Toolset] | None = None,
    ) -> MultiTurnBatch:
        """G completions per prompt with tool calls; ``toolsets``: one per row (per-rollout
        environments, rows ``i*G .. i*G+G-1`` of prompt ``i``), default the settings' toolset."""
        engine = self.engine
        params = params if params is not None else self.params
        params.validate()
        if params.stop_strings:
            raise ConfigError(
                "stop_strings are not supported with tool calling (a turn ends at EOS or a stop token id); "
                "use stop_token_ids or remove stop_strings"
            )
        n_rows = len(prompts) * params.num_generations
        if toolsets is None:
            toolsets = [self.tools.toolset] * n_rows
        if len(toolsets) != n_rows:
            raise DataError(
                f"got {len(toolsets)} toolsets for {len(prompts)} prompts × {params.num_generations} generations; "
                "pass one toolset per completion row"
            )
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=engine.device)
            generator.manual_seed(params.seed)
        was_training = engine.model.training
        engine.model.eval()
        try:
            return self._generate(prompts, params, generator, list(toolsets))
        finally:
            if was_training:
                engine.model.train()

    def _render(self, prompts: Sequence[Prompt], toolsets: Sequence[Toolset], group: int) -> list[str]:
        """Chat prompts rendered with their rows' tool schemas; plain strings as they are."""
        tokenizer, texts = self.engine.tokenizer, []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                texts.append(p)
                continue
            if getattr(tokenizer, "chat_template", None) is None:
                texts.extend(self.engine._render([p]))  # raises the engine's error for this case
                continue
            texts.append(tokenizer.apply_chat_template(
                list(p), tools=toolsets[i * group].schemas, tokenize=False, add_generation_prompt=True,
                **dict(self.tools.chat_template_kwargs or {}),
            ))
        return texts

    def _generate(
        self, prompts: list[Prompt], params: SamplingParams, generator: torch.Generator | None,
        toolsets: list[Toolset],
    ) -> MultiTurnBatch:
        engine, t_start = self.engine, time.perf_counter()
        dev, pad = engine.device, engine.pad_token_id
        bucket = params.length_bucket if params.length_bucket is not None else default_length_bucket(dev)
        group, max_new = params.num_generations, params.max_completion_length
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise DataError("prompts must be a non-empty list of strings or chat message lists")
        ids, rendered = engine._tokenize(self._render(prompts, toolsets, group), params)
        n_prompts, n_rows = len(ids), len(ids) * group

        lens = [len(r) for r in ids]
        lp = round_up(max(lens), bucket)
        host_ids = torch.tensor([[pad] * (lp - len(r)) + r for r in ids], dtype=torch.long)
        host_mask = torch.arange(lp).unsqueeze(0) >= torch.tensor([lp - n for n in lens]).unsqueeze(1)
        prompt_ids, prompt_mask = host_ids.to(dev), host_mask.to(dev)

        position_ids = (prompt_mask.long().cumsum(-1) - 1).clamp_min(0)
        prefill_cache = BucketedKVCache(engine.num_layers, lp, bucket)
        logits = engine._forward(prompt_ids, prompt_mask, position_ids, prefill_cache)
        lc = round_up(max_new, bucket)
        cache = prefill_cache.expand_into(group, lp + lc)
        del prefill_cache
        _synchronize(dev)
        t_prefill = time.perf_counter()

        logits = logits.repeat_interleave(group, dim=0)
        vocab = logits.shape[-1]
        next_position = torch.tensor(lens, dtype=torch.long).repeat_interleave(group).to(dev)
        attn = torch.zeros((n_rows, lp + lc), dtype=torch.bool, device=dev)
        attn[:, :lp] = prompt_mask.repeat_interleave(group, dim=0)
        seen = None
        if params.repetition_penalty != 1.0:
            seen_prompt = torch.zeros((n_prompts, vocab + 1), dtype=torch.bool, device=dev)
            seen_prompt.scatter_(1, prompt_ids.masked_fill(~prompt_mask, vocab), True)
            seen = seen_prompt[:, :vocab].repeat_interleave(group, dim=0)
        stop_list = sorted(
            set(([] if params.ignore_eos else engine.eos_token_ids) + [int(t) for t in params.stop_token_ids])
        )
        stop_ids = torch.tensor(stop_list, dtype=torch.long, device=dev) if stop_list else None

        out_ids = torch.full((n_rows, lc), pad, dtype=torch.long, device=dev)
        out_lp = torch.zeros((n_rows, lc), dtype=torch.float32, device=dev)
        out_gen = torch.zeros((n_rows, lc), dtype=torch.bool, device=dev)
        pos = torch.zeros(n_rows, dtype=torch.long, device=dev)  # per output row
        rows = [_Row() for _ in range(n_rows)]
        truncated = [False] * n_rows
        row_map = torch.arange(n_rows, device=dev)  # decode-batch row -> output row
        done = torch.zeros(n_rows, dtype=torch.bool, device=dev)
        buckets = _row_buckets(n_rows)
        batch_sizes = [n_rows]
        step_results: list[list[Any]] = [[] for _ in range(n_rows)]
        counts: Counter[str] = Counter()
        tool_seconds = 0.0
        col, steps = lp, 0
        # One-token steps use the engine's decode model (compiled when configured); the few steps
        # that append tool responses are wider and run the plain model.
        decode_model = engine._decode_model(params, dev)

        while True:
            tokens, lps = next_tokens(logits, params, seen, generator)
            alive = ~done
            tokens = tokens.masked_fill(done, pad)
            where = pos[row_map]
            live_rows, live_cols = row_map[alive], where[alive]
            out_ids[live_rows, live_cols] = tokens[alive]
            out_lp[live_rows, live_cols] = lps[alive].float()
            out_gen[live_rows, live_cols] = True
            pos[live_rows] += 1
            if seen is not None:
                seen.scatter_(1, tokens.unsqueeze(1), True)
            ended = alive & (tokens.unsqueeze(1) == stop_ids).any(dim=1) if stop_ids is not None else alive & False
            steps += 1

            host_alive, host_ended = alive.tolist(), ended.tolist()
            host_map, host_tokens, host_pos = row_map.tolist(), tokens.tolist(), pos.tolist()
            finished: list[int] = []  # batch indices finished at this step
            turn_rows: list[int] = []  # batch indices whose turn ended with room to go on
            for b, r in enumerate(host_map):
                if not host_alive[b]:
                    continue
                row = rows[r]
                row.pos = host_pos[r]
                row.feed = [host_tokens[b]]
                if host_ended[b]:
                    turn_rows.append(b)
                elif row.pos >= max_new:  # cut mid-turn
                    truncated[r] = True
                    row.messages.append(self._parse(self._turn_text(out_ids, r, row, stop_list)).assistant_message())
                    finished.append(b)
            if turn_rows:
                t0 = time.perf_counter()
                finished += self._tool_step(
                    turn_rows, host_map, rows, toolsets, out_ids, out_lp, pos, truncated, step_results, counts,
                    max_new, seen, stop_list,
                )
                tool_seconds += time.perf_counter() - t0
            if finished:
                done = done.clone()
                done[torch.tensor(finished, device=dev)] = True
            n_alive = len([b for b in range(len(host_map)) if host_alive[b]]) - len(finished)
            if n_alive == 0:
                break

            target = min(b for b in buckets if b >= n_alive)
            if engine.compact and target < len(host_map):
                keep = torch.argsort(done.to(torch.int32), stable=True)[:target]
                cache.select_rows(keep)
                keep_host = keep.tolist()
                row_map, tokens, next_position, attn, done = (
                    row_map[keep], tokens[keep], next_position[keep], attn[keep], done[keep]
                )
                host_map = [host_map[k] for k in keep_host]
                if seen is not None:
                    seen = seen[keep]
                batch_sizes.append(target)

            host_done = done.tolist()
            feeds = [[pad] if host_done[b] else rows[r].feed for b, r in enumerate(host_map)]
            width = max(len(f) for f in feeds)
            if col + width > cache.capacity:
                attn = _grow(cache, attn, round_up(col + width + max_new, bucket))
            if width == 1:
                step_ids = tokens.unsqueeze(1)
                step_pos = next_position.unsqueeze(1)
                attn[:, col] = True
                next_position = next_position + 1
            else:
                n_fed = torch.tensor([len(f) for f in feeds], device=dev)
                step_ids = torch.tensor([[pad] * (width - len(f)) + f for f in feeds], device=dev)
                offsets = torch.arange(width, device=dev).unsqueeze(0) - (width - n_fed).unsqueeze(1)
                attn[:, col : col + width] = offsets >= 0
                step_pos = next_position.unsqueeze(1) + offsets.clamp_min(0)
                next_position = next_position + n_fed
            view = cache.layers[0].view_length(col + width)
            logits = engine._forward(step_ids, attn[:, :view], step_pos, cache, decode_model if width == 1 else None)
            col += width
        del cache, logits

        lengths = pos
        lengths_host = lengths.tolist()
        width = min(lc, round_up(max(lengths_host), bucket))
        columns = torch.arange(lc, device=dev).unsqueeze(0)
        context = columns < lengths.unsqueeze(1)
        out_ids, out_lp, out_gen, context = (x[:, :width].contiguous() for x in (out_ids, out_lp, out_gen, context))
        t_decode = time.perf_counter()
        host_rows = out_ids.tolist()
        completion_texts = engine.tokenizer.batch_decode(
            [r[:n] for r, n in zip(host_rows, lengths_host)], skip_special_tokens=True
        )
        turns = [r.iterations + 1 for r in rows]
        metrics = tool_metrics(step_results)
        metrics["tools/turns_per_completion"] = sum(turns) / n_rows
        metrics["tools/wall_time_s"] = tool_seconds
        metrics["tools/length_limited"] = float(counts["length_limited"])
        metrics["tools/iteration_limited"] = float(counts["iteration_limited"])
        t_end = time.perf_counter()
        return MultiTurnBatch(
            prompt_ids=prompt_ids.repeat_interleave(group, dim=0),
            prompt_mask=prompt_mask.long().repeat_interleave(group, dim=0),
            completion_ids=out_ids,
            completion_mask=context.long(),
            sampling_logprobs=out_lp,
            truncated=torch.tensor(truncated, device=dev),
            prompt_texts=[text for text in rendered for _ in range(group)],
            completion_texts=completion_texts,
            num_generations=group,
            completion_lengths=lengths,
            timing={
                "prefill_s": t_prefill - t_start,
                "decode_s": t_decode - t_prefill - tool_seconds,
                "tools_s": tool_seconds,
                "decode_text_s": t_end - t_decode,
                "total_s": t_end - t_start,
                "steps": float(steps),
                "tokens": float(out_gen.sum()),
            },
            decode_batch_sizes=batch_sizes,
            tool_mask=out_gen.long(),
            messages=[r.messages for r in rows],
            num_turns=torch.tensor(turns, device=dev),
            tool_metrics=metrics,
        )

    def _turn_text(self, out_ids: Tensor, r: int, row: _Row, stop_list: list[int]) -> str:
        """The current turn of output row ``r`` as text, tool tags kept, without its end token."""
        toks = out_ids[r, row.turn_start : row.pos].tolist()
        if toks and toks[-1] in stop_list:
            toks = toks[:-1]
        return self.engine.tokenizer.decode(toks, skip_special_tokens=False)

    def _parse(self, text: str) -> Any:
        return get_tool_call_parser(self.tools.parser)(text)

    def _tool_step(
        self, turn_rows: list[int], host_map: list[int], rows: list[_Row], toolsets: list[Toolset],
        out_ids: Tensor, out_lp: Tensor, pos: Tensor, truncated: list[bool], step_results: list[list[Any]],
        counts: Counter[str], max_new: int, seen: Tensor | None, stop_list: list[int],
    ) -> list[int]:
        """One tool step over the rows (batch indices) that ended a turn; returns those that finished."""
        limit = self.tools.max_tool_calling_iterations
        texts = {b: self._turn_text(out_ids, host_map[b], rows[host_map[b]], stop_list) for b in turn_rows}
        finished: list[int] = []
        runnable: list[int] = []
        for b in turn_rows:
            row = rows[host_map[b]]
            if row.pos >= max_new or (limit is not None and row.iterations >= limit):
                turn = self._parse(texts[b])
                row.messages.append(turn.assistant_message())
                if turn.has_calls:
                    counts["length_limited" if row.pos >= max_new else "iteration_limited"] += 1
                    truncated[host_map[b]] = row.pos >= max_new
                finished.append(b)
            else:
                runnable.append(b)
        if not runnable:
            return finished
        steps = run_tool_step(
            [texts[b] for b in runnable], [toolsets[host_map[b]] for b in runnable], self.tools.executor,
            self.engine.tokenizer, self.tools.parser, self.tools.chat_template_kwargs,
        )
        dev = out_ids.device
        for b, step in zip(runnable, steps):
            r = host_map[b]
            row = rows[r]
            row.messages.extend(step.messages())
            step_results[r].extend(step.results)
            if not step.continues:
                finished.append(b)
                continue
            suffix = step.suffix_ids
            if row.pos + len(suffix) >= max_new:  # no room for the response and one more token
                counts["length_limited"] += 1
                truncated[r] = True
                finished.append(b)
                continue
            out_ids[r, row.pos : row.pos + len(suffix)] = torch.tensor(suffix, device=dev)
            out_lp[r, row.pos : row.pos + len(suffix)] = 0.0
            row.pos += len(suffix)
            pos[r] = row.pos
            row.turn_start = row.pos
            row.iterations += 1
            row.feed = row.feed + list(suffix)
            if seen is not None:
                seen[b, torch.tensor(suffix, device=dev)] = True
        return finished


def _grow(cache: BucketedKVCache, attn: Tensor, capacity: int) -> Tensor:
    """Reallocate every layer of ``cache`` (and the attention mask) to ``capacity`` columns."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            old = getattr(layer, name)
            new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[-1]))
            new[:, :, : layer.length].copy_(old[:, :, : layer.length])
            setattr(layer, name, new)
        layer.capacity = capacity
    cache.capacity = capacity
    grown = attn.new_zeros((attn.shape[0], capacity))
    grown[:, : attn.shape[1]] = attn
    return grown
