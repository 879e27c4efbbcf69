"""Smoke check: vLLM (vllm-ascend on Ascend) colocated in this process, its sampling log-probs against the
trainer's log-prob forward on the same weights. Skipped when vLLM does not import."""

from __future__ import annotations

import importlib.util

import torch

from grpo_ascend.models.policy import CompletionLogprobs, resolve_model_path
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.vllm import VLLMColocatedRollout  # vLLM itself loads only when the backend is built
from grpo_ascend.smoke.context import BUILTIN_MODEL, SmokeContext, prompt_texts
from grpo_ascend.smoke.report import CheckResult

#: Largest |vLLM log-prob - trainer log-prob| accepted, per precision (tests/rollout/vllm_backend/test_vllm_colocated.py: 1e-4 in fp32).
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1}


def check_vllm(ctx: SmokeContext) -> CheckResult:
    """Colocated vLLM's log-probs of its own samples vs the trainer's, on the built-in model."""
    if importlib.util.find_spec("vllm") is None:
        return CheckResult("vllm", "skipped", "vLLM is not installed",
                           reason="install vllm + vllm-ascend (docs/ascend.md#versions) to check it")
    policy, tokenizer = ctx.load(BUILTIN_MODEL)
    params = SamplingParams(num_generations=ctx.generations, temperature=1.0, max_completion_length=ctx.new_tokens,
                            max_prompt_length=None, seed=0)
    rollout = VLLMColocatedRollout(resolve_model_path(BUILTIN_MODEL), tokenizer, params, device=ctx.device,
                                   dtype=ctx.dtype, kv_cache_memory_bytes=64 * 2**20, max_model_length=1024)
    try:
        batch = rollout.generate(prompt_texts(tokenizer), params)
    finally:
        rollout.close()
    with torch.no_grad():
        logps, _ = CompletionLogprobs(policy)(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                              batch.completion_mask, temperature=1.0)
    error = float(((logps - batch.sampling_logprobs) * batch.completion_mask).abs().max())
    tolerance = TOLERANCE.get(ctx.dtype, 0.1)
    numbers = {"max_abs_logprob_diff": error, "tolerance": tolerance,
               "tokens": int(batch.completion_mask.sum()), "dtype": ctx.dtype}
    summary = f"max |vLLM - trainer| log-prob {error:.2e} over {numbers['tokens']} tokens (tolerance {tolerance:g})"
    if error > tolerance:
        return CheckResult("vllm", "failed", summary, numbers, "vLLM samples from other weights or numerics than "
                           "the trainer computes; see docs/vllm.md")
    return CheckResult("vllm", "ok", summary, numbers)
