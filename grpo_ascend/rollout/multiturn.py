"""Multi-turn rollouts with tool calls, on any rollout backend's session (token ids in and out).

:class:`MultiTurnEngine` drives a :class:`~grpo_ascend.rollout.backend.RolloutSession` of its
backend: G rows per prompt are sampled until rows end an assistant turn (EOS, the template's end
of turn); each such turn is parsed for tool calls. All rows that ended a turn at the same
``advance`` go through one :func:`~grpo_ascend.tools.run_tool_step` (their calls run
concurrently); a row with calls gets its tool responses and the next assistant header appended
and keeps decoding, a row without calls is finished. The built-in engine's session
(:mod:`grpo_ascend.rollout.session`) continues rows on their KV cache, never re-prefilled.

Output: a :class:`RolloutBatch` with ``tool_mask`` (1 on
generated tokens, 0 on tool-response tokens and padding), the conversation messages per row and
tool metrics. ``completion_ids`` hold generated and tool tokens interleaved, ``completion_mask``
marks them all (the context), ``sampling_logprobs`` are 0 on tool tokens.

Vision-language models (a ``processor`` given): prompts keep their images, encoded once in each prompt's
prefill; a tool may return images (content blocks, :mod:`grpo_ascend.tools.content`), rendered with the
processor (:mod:`grpo_ascend.rollout.tool_images`) and fed on the row's cache with their features
(:mod:`grpo_ascend.rollout.session`); the batch's ``vision`` holds each row's prompt and tool images in order.

Limits: ``max_completion_length`` counts generated and tool tokens together, a tool image's tokens
included (a tool response that does not fit ends the row as truncated); ``max_tool_calling_iterations``
tool steps per row (a turn with calls past the limit ends the row, its calls not run); tool output
truncation is the executor's ``max_output_chars``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.rollout.backend import (
    RolloutBackend,
    RolloutBatch,
    RolloutSession,
    SessionOutput,
    TurnEnd,
    tool_images_refused,
)
from grpo_ascend.rollout.image_prompts import VisionPromptEncoder
from grpo_ascend.rollout.prompts import Prompt, check_prompts
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.tool_images import has_images, render_image_suffix
from grpo_ascend.tools.execution import ToolExecutor, tool_metrics
from grpo_ascend.tools.parsing import get_tool_call_parser
from grpo_ascend.tools.toolset import Toolset
from grpo_ascend.tools.turns import run_tool_step
from grpo_ascend.vision.inputs import PromptImages, RowVision


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

    iterations: int = 0  # tool steps taken
    messages: list[dict[str, Any]] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)  # the tool calls' results


@dataclass
class _Loop:
    """One rollout's tool-loop state: per-row bookkeeping, truncation flags, limit counts, tool time."""

    rows: list[_Row]
    toolsets: list[Toolset]
    max_new: int
    truncated: list[bool]
    counts: Counter[str] = field(default_factory=Counter)
    tool_seconds: float = 0.0


class MultiTurnEngine:
    """Multi-turn tool-calling rollouts on a :class:`RolloutBackend`; see the module docstring. ``processor``: a
    vision-language model's processor (prompts with images, tools returning images)."""

    def __init__(self, backend: RolloutBackend, tools: ToolSettings, processor: Any = None) -> None:
        if processor is not None and not backend.takes_tool_images:
            raise ConfigError(tool_images_refused(backend))
        if processor is not None and not tools.executor.takes_images:
            raise ConfigError("a vision-language model's tool loop needs ToolExecutor(takes_images=True), or its tools' "
                              "images are refused as for a text-only model")
        self.backend = backend
        self.tools = tools
        self.params = backend.params
        self.processor = processor
        self._vision = VisionPromptEncoder(processor) if processor is not None else None

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        toolsets: Sequence[Toolset] | None = None,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> RolloutBatch:
        """G completions per prompt with tool calls; ``toolsets``: one per row (per-rollout
        environments, rows ``i*G .. i*G+G-1`` of prompt ``i``), default the settings' toolset;
        ``images``: each prompt's decoded images (a vision-language model's processor given)."""
        params = self.backend.checked(params)
        if params.stop_strings:
            raise ConfigError(
                "stop_strings are not supported with tool calling (a turn ends at EOS or a stop token id); "
                "use stop_token_ids or remove stop_strings"
            )
        check_prompts(prompts)
        group = params.num_generations
        n_rows = len(prompts) * group
        toolsets = list(toolsets) if toolsets is not None else [self.tools.toolset] * n_rows
        if len(toolsets) != n_rows:
            raise DataError(
                f"got {len(toolsets)} toolsets for {len(prompts)} prompts × {group} generations; "
                "pass one toolset per completion row"
            )
        if images is not None and self._vision is None:
            raise ConfigError("prompts with images need a vision-language model's processor in the tool loop; pass "
                              "processing_class=<processor>, or drop the image columns")
        t_start = time.perf_counter()
        schemas = [toolsets[i * group].schemas for i in range(len(prompts))]
        kwargs = self.tools.chat_template_kwargs or {}
        prompt_images: list[PromptImages] | None = None
        if self._vision is not None:
            pictures = images if images is not None else [[] for _ in prompts]
            encoded, prompt_images = self._vision.encode(prompts, pictures, params, kwargs, tools=schemas)
            session = self.backend.start_image_session(encoded.ids, prompt_images, params, generator)
        else:
            encoded = self.backend.prompts.encode(prompts, params, tools=schemas, chat_template_kwargs=kwargs)
            session = self.backend.start_session(encoded.ids, params, generator)
        loop = _Loop([_Row() for _ in range(n_rows)], toolsets, params.max_completion_length, [False] * n_rows)
        with session:
            t_prefill = time.perf_counter()
            while ends := session.advance():
                self._handle(ends, loop, session)
            out = session.output()
        t_decode = time.perf_counter()
        batch = self._batch(encoded.texts, out, loop, group)
        if prompt_images is not None:
            batch.vision = RowVision(RowVision.repeated(prompt_images, group).rows, out.tool_images or None)
        t_end = time.perf_counter()
        batch.timing = {
            "prefill_s": t_prefill - t_start,
            "decode_s": t_decode - t_prefill - loop.tool_seconds,
            "tools_s": loop.tool_seconds,
            "decode_text_s": t_end - t_decode,
            "total_s": t_end - t_start,
            "steps": float(out.steps),
            "tokens": float(out.generated.sum()),
        }
        return batch

    def _batch(self, prompt_texts: list[str], out: SessionOutput, loop: _Loop, group: int) -> RolloutBatch:
        """The session's completions with the prompts, texts, masks and tool metrics."""
        dev = self.backend.device
        lengths = out.lengths
        lengths_host = lengths.tolist()
        context = torch.arange(out.completion_ids.shape[1], device=dev).unsqueeze(0) < lengths.unsqueeze(1)
        turns = [r.iterations + 1 for r in loop.rows]
        metrics = tool_metrics([r.results for r in loop.rows])
        metrics["tools/turns_per_completion"] = sum(turns) / len(loop.rows)
        metrics["tools/wall_time_s"] = loop.tool_seconds
        metrics["tools/length_limited"] = float(loop.counts["length_limited"])
        metrics["tools/iteration_limited"] = float(loop.counts["iteration_limited"])
        return RolloutBatch(
            prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
            completion_mask=context.long(), sampling_logprobs=out.sampling_logprobs,
            truncated=torch.tensor(loop.truncated, device=dev),
            prompt_texts=[text for text in prompt_texts for _ in range(group)],
            completion_texts=self.backend.prompts.decode_completions(out.completion_ids, lengths_host),
            num_generations=group, completion_lengths=lengths, decode_batch_sizes=out.decode_batch_sizes,
            tool_mask=out.generated.long(), messages=[r.messages for r in loop.rows],
            num_turns=torch.tensor(turns, device=dev), tool_metrics=metrics, policy_versions=out.policy_versions,
        )

    def _turn_text(self, end: TurnEnd) -> str:
        """The row's turn as text, tool tags kept, without its end token."""
        toks = end.tokens[:-1] if end.stopped and end.tokens else end.tokens
        return self.backend.tokenizer.decode(toks, skip_special_tokens=False)

    def _parse(self, text: str) -> Any:
        return get_tool_call_parser(self.tools.parser)(text)

    def _handle(self, ends: list[TurnEnd], loop: _Loop, session: RolloutSession) -> None:
        """Rows cut by the length limit end with their partial turn; rows that ended a turn take a tool step."""
        for end in ends:
            if not end.stopped:
                loop.truncated[end.row] = True
                loop.rows[end.row].messages.append(self._parse(self._turn_text(end)).assistant_message())
        turn_ends = [end for end in ends if end.stopped]
        if turn_ends:
            t0 = time.perf_counter()
            self._tool_step(turn_ends, loop, session)
            loop.tool_seconds += time.perf_counter() - t0

    def _tool_step(self, ends: list[TurnEnd], loop: _Loop, session: RolloutSession) -> None:
        """One tool step over the rows that ended a turn; rows that continue get their tool responses appended."""
        limit, max_new = self.tools.max_tool_calling_iterations, loop.max_new
        texts = {end.row: self._turn_text(end) for end in ends}
        runnable: list[TurnEnd] = []
        for end in ends:
            row = loop.rows[end.row]
            if end.length >= max_new or (limit is not None and row.iterations >= limit):
                turn = self._parse(texts[end.row])
                row.messages.append(turn.assistant_message())
                if turn.has_calls:
                    loop.counts["length_limited" if end.length >= max_new else "iteration_limited"] += 1
                    loop.truncated[end.row] = end.length >= max_new
            else:
                runnable.append(end)
        if not runnable:
            return
        steps = run_tool_step(
            [texts[end.row] for end in runnable], [loop.toolsets[end.row] for end in runnable], self.tools.executor,
            self.backend.tokenizer, self.tools.parser, self.tools.chat_template_kwargs,
        )
        for end, step in zip(runnable, steps):
            row = loop.rows[end.row]
            row.messages.extend(step.messages())
            row.results.extend(step.results)
            if not step.continues:
                continue
            suffix, images = step.suffix_ids, None
            if self.processor is not None and has_images(step.results):
                suffix, images = render_image_suffix(self.processor, step.results, self.tools.chat_template_kwargs)
            if end.length + len(suffix) >= max_new:  # no room for the response (its image tokens too) and one more token
                loop.counts["length_limited"] += 1
                loop.truncated[end.row] = True
                continue
            if images is not None:
                session.append_with_images(end.row, suffix, images)
            else:
                session.append(end.row, suffix)
            row.iterations += 1
