"""The tool-use warm start of ``builtin:tiny-tool-warm``: synthetic calculator transcripts.

The tiny model never saw a tool call, so it does not call tools by itself. This supervised phase,
run on top of the ``tiny-warm`` model, shows it products of a 3-digit and a 2-digit number (too
hard for it to compute) in three kinds of transcript:

- tools listed, the model calls ``calculator`` with the product, the tool answers, the model puts
  the tool's result in ``<answer>`` tags;
- tools listed, the model answers directly (a guess: it cannot compute the product);
- no tools listed, the model answers directly (what the demo's no-tool control sees).

Each transcript is tokenized the way a multi-turn rollout builds it (the prompt rendered by the
chat template, the generated call and EOS, the rendered tool suffix, the answer and EOS), and the
loss covers only the model's own tokens. The run is stopped early (:data:`TOOL_WARM_PHASES`), so the
model calls the tool in most but not all rollouts and copies arguments and results imperfectly:
accuracy that RL can raise by calling the tool and copying its result.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from grpo_ascend.data.synthetic import SYSTEM_PROMPT, conversation, product_problems
from grpo_ascend.models.seeding import seeded
from grpo_ascend.models.warm_step import supervised_step
from grpo_ascend.tools.calculator import calculator
from grpo_ascend.tools.execution import ToolResult
from grpo_ascend.tools.render import render_tool_suffix
from grpo_ascend.tools.toolset import tool_from_function

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolWarmStart:
    """One phase: optimizer steps, batch size, peak learning rate, the share of transcripts with
    tools listed and, among those, the share that calls the calculator; ``seed_offset`` is added to
    the build seed (the phase's problems, kinds and RNG)."""

    steps: int
    batch_size: int
    lr: float
    with_tools: float
    calls: float
    seed_offset: int = 0


#: The phases, each with a fresh optimizer: a first pass over all three kinds teaches the format; two
#: call-heavy passes at higher learning rates then teach copying the question's numbers into the call
#: and the tool's result into the answer (it appears only after a few hundred steps). The result calls
#: the tool in ~85% of rollouts and is right in about half at temperature 1 (none without the tool).
TOOL_WARM_PHASES = (
    ToolWarmStart(steps=150, batch_size=32, lr=1e-3, with_tools=0.75, calls=0.8, seed_offset=0),
    ToolWarmStart(steps=100, batch_size=16, lr=2e-3, with_tools=0.9, calls=0.9, seed_offset=5),
    ToolWarmStart(steps=200, batch_size=16, lr=3e-3, with_tools=0.9, calls=0.9, seed_offset=6),
)


#: Further call-heavy passes, taken only while the greedy tool calls copy the expression of fewer than
#: COPY_CRITERION of held-out questions: a warm start from another seed (another machine's float order)
#: can end the phases above calling the tool in the right format with the wrong numbers, and then every
#: sampled group scores alike and GRPO has nothing to learn from (a seed-1 warm start built on an AMD EPYC
#: got the expression right in 2 of 32 calls where seed 0 got 13, and the calculator test failed on it).
#: Greedily, seed 0 (shipped) copies 26 of 32 and seed 1 built on an AVX-512 Xeon 32 of 32: neither takes one.
EXTRA_PHASE = ToolWarmStart(steps=100, batch_size=16, lr=3e-3, with_tools=0.9, calls=0.9, seed_offset=7)
COPY_CRITERION = 0.5
MAX_EXTRA_PHASES = 4


def tool_transcript(tokenizer: Any, question: str, answer: int, kind: str) -> tuple[list[int], list[int]]:
    """(ids, labels) of one transcript; ``kind`` is ``call``, ``direct`` (tools listed) or ``no_tools``.

    Labels are -100 on the prompt and the tool suffix (what the model does not generate).
    """
    messages = conversation(question, SYSTEM_PROMPT)
    tools = [tool_from_function(calculator).schema] if kind != "no_tools" else None
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = _encode(tokenizer, prompt)
    labels = [-100] * len(ids)
    eos = tokenizer.eos_token_id
    if kind == "call":
        expression = _expression(question)
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                                  "arguments": {"expression": expression}}}]}
        rendered = tokenizer.apply_chat_template([*messages, call], tools=tools, tokenize=False)
        call_text = rendered[len(prompt):].removesuffix("\n").removesuffix(tokenizer.eos_token)
        call_ids = _encode(tokenizer, call_text) + [eos]
        suffix = render_tool_suffix(tokenizer, [ToolResult("calculator", calculator(expression))])
        ids += call_ids + suffix
        labels += call_ids + [-100] * len(suffix)
    answer_ids = _encode(tokenizer, f"<answer>{answer}</answer>") + [eos]
    return ids + answer_ids, labels + answer_ids


def tool_warm_start(model: Any, tokenizer: Any, seed: int = 0, phases: tuple[ToolWarmStart, ...] = TOOL_WARM_PHASES) -> Any:
    """The calculator warm start of ``model`` (in place), phase after phase, then :data:`EXTRA_PHASE` passes
    while its calls copy too few expressions (at most :data:`MAX_EXTRA_PHASES`); returns ``model``."""
    for phase in phases:
        tool_warm_phase(model, tokenizer, phase, seed + phase.seed_offset)
    for extra in range(MAX_EXTRA_PHASES):
        copied = call_copy_accuracy(model, tokenizer, seed=seed)
        if copied >= COPY_CRITERION:
            break
        logger.info("tool warm start: calls copy %.2f of the expressions (< %.2f): one more call-heavy pass",
                    copied, COPY_CRITERION)
        tool_warm_phase(model, tokenizer, EXTRA_PHASE, seed + EXTRA_PHASE.seed_offset + extra)
    return model


def call_copy_accuracy(model: Any, tokenizer: Any, n: int = 32, seed: int = 0, max_new_tokens: int = 96) -> float:
    """Share of ``n`` held-out questions whose greedy first reply is a calculator call carrying the
    question's expression exactly (what GRPO needs some of to have groups with different rewards)."""
    import torch

    tools = [tool_from_function(calculator).schema]
    hits = 0
    model.eval()
    with torch.no_grad():
        for problem in product_problems(n, seed=seed + 97):
            prompt = tokenizer.apply_chat_template(conversation(problem.question, SYSTEM_PROMPT), tools=tools,
                                                   tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([_encode(tokenizer, prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
            reply = tokenizer.decode(out[0, ids.shape[1]:])
            expression = _expression(problem.question)
            hits += "calculator" in reply and f'"{expression}"'.replace(" ", "") in reply.replace(" ", "")
    return hits / n


def tool_warm_phase(model: Any, tokenizer: Any, settings: ToolWarmStart, seed: int,
                    losses: list[float] | None = None) -> Any:
    """One supervised phase on the calculator transcripts (loss on the model's tokens only); each step's
    loss is appended to ``losses`` when given."""
    import torch

    n = settings.steps * settings.batch_size
    problems = product_problems(n, seed=seed + 11)
    rng = random.Random(seed + 12)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    with seeded(seed + 13):
        for step in range(settings.steps):
            rows = []
            for p in problems[step * settings.batch_size : (step + 1) * settings.batch_size]:
                listed = rng.random() < settings.with_tools
                kind = ("call" if rng.random() < settings.calls else "direct") if listed else "no_tools"
                rows.append(tool_transcript(tokenizer, p.question, p.answer, kind))
            ids, labels = _right_padded(rows, tokenizer.pad_token_id)
            loss = supervised_step(model, opt, sched, ids, _attention(rows, ids), labels, losses)
            if step % 50 == 0 or step == settings.steps - 1:
                logger.info("tool warm start step %d/%d loss %.4f", step + 1, settings.steps, loss)
    model.eval()
    return model


def _expression(question: str) -> str:
    """The arithmetic of a product question ("What is 12 * 34?" -> "12 * 34"), as the calculator gets it."""
    return question.removeprefix("What is ").removesuffix("?")


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _right_padded(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[Any, Any]:
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return ids, labels


def _attention(rows: list[tuple[list[int], list[int]]], ids: Any) -> Any:
    import torch

    mask = torch.zeros_like(ids)
    for i, (r, _) in enumerate(rows):
        mask[i, : len(r)] = 1
    return mask
