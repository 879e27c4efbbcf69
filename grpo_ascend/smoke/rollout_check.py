"""Smoke check: the built-in rollout engine against Hugging Face ``generate`` on the built-in model.

Greedy decoding must give the same tokens up to each completion's first EOS (exactly in fp32; reduced
precision may flip a near-tie, which the result reports as the first differing position; past EOS the
built-in model's logits are nearly flat, so those tokens are not compared). Sampled throughput: G completions per prompt of
``new_tokens`` each (EOS ignored by both, so both generate the same number of tokens), one warm-up, then one
timed call each.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from grpo_ascend import device as dev
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.smoke.context import BUILTIN_MODEL, SmokeContext, prompt_texts
from grpo_ascend.smoke.report import CheckResult


def _hf_generate(model: Any, tokenizer: Any, prompts: list[str], new_tokens: int, sample: bool,
                 generations: int = 1, eos: list[int] | None = None) -> torch.Tensor:
    enc = tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left",
                    return_tensors="pt").to(model.device)
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    config.eos_token_id = eos or None  # None: run to max_new_tokens, as the engine does with ignore_eos
    config.pad_token_id = tokenizer.pad_token_id
    options = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**enc, generation_config=config, max_new_tokens=new_tokens,
                             num_return_sequences=generations, **options)
    return out[:, enc["input_ids"].shape[1]:]


def _timed(fn: Any, device: torch.device) -> float:
    dev.synchronize(device)
    start = time.perf_counter()
    fn()
    dev.synchronize(device)
    return time.perf_counter() - start


def until_eos(ids: torch.Tensor, eos: list[int]) -> list[list[int]]:
    """Each row's tokens up to and including its first EOS token."""
    rows = []
    for row in ids.tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(row, position) of the first differing token of two lists of token rows, or None when equal."""
    for r, (x, y) in enumerate(zip(a, b)):
        for position in range(max(len(x), len(y))):
            if position >= len(x) or position >= len(y) or x[position] != y[position]:
                return r, position
    return None


def check_rollout(ctx: SmokeContext) -> CheckResult:
    """Greedy equality with ``generate`` and tokens/s of both engines on the built-in model."""
    model, tokenizer = ctx.load(BUILTIN_MODEL)
    prompts = prompt_texts(tokenizer)
    engine = RolloutEngine(model, tokenizer)
    greedy = SamplingParams(num_generations=1, temperature=0, max_completion_length=ctx.new_tokens,
                            max_prompt_length=None)
    eos = engine.eos_token_ids
    ours = until_eos(engine.generate(prompts, greedy).completion_ids, eos)
    theirs = until_eos(_hf_generate(model, tokenizer, prompts, ctx.new_tokens, sample=False, eos=eos), eos)
    where = first_difference(ours, theirs)

    sampled = SamplingParams(num_generations=ctx.generations, temperature=1.0, max_completion_length=ctx.new_tokens,
                             ignore_eos=True, max_prompt_length=None, seed=0)
    tokens = len(prompts) * ctx.generations * ctx.new_tokens

    def run_ours() -> None:
        engine.generate(prompts, sampled)

    def run_theirs() -> None:
        _hf_generate(model, tokenizer, prompts, ctx.new_tokens, sample=True, generations=ctx.generations)

    run_ours(), run_theirs()  # warm-up (allocator, kernels)
    ours_s, theirs_s = _timed(run_ours, ctx.device), _timed(run_theirs, ctx.device)
    numbers = {
        "greedy_equal": where is None, "first_difference": list(where) if where else None,
        "greedy_tokens_compared": sum(len(row) for row in ours),
        "tokens": tokens, "engine_tokens_per_s": tokens / ours_s, "generate_tokens_per_s": tokens / theirs_s,
        "speedup": theirs_s / ours_s, "prompts": len(prompts), "generations": ctx.generations,
        "new_tokens": ctx.new_tokens, "dtype": ctx.dtype,
    }
    summary = (f"greedy {'equal' if where is None else f'differs at row {where[0]} token {where[1]}'}; "
               f"{numbers['engine_tokens_per_s']:.0f} vs {numbers['generate_tokens_per_s']:.0f} tokens/s "
               f"({numbers['speedup']:.2f}x generate)")
    exact = ctx.dtype == "float32"
    if where is not None and exact:
        return CheckResult("rollout", "failed", summary, numbers,
                           "fp32 greedy decoding must match generate token for token")
    return CheckResult("rollout", "ok", summary, numbers)
