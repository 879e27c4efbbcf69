"""Shared-prefix decode attention: exact attention over prompt + completion, read once per prompt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpo_ascend import device as dev
from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout import shared_prefix
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.kv_cache import BucketedKVCache
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.shared_prefix import (
    SharedPrefixKVCache,
    shared_prefix_decoding,
    supports_shared_prefix,
)

PROMPTS = ["The quick brown fox", "a", "Once upon a time there was", "12 + 30 ="]


def _reference(query, prompt_k, prompt_v, prompt_valid, row_prompt, comp_k, comp_v):
    """Plain SDPA over each row's own copy of its prompt followed by its completion."""
    rows, heads = query.shape[:2]
    rep = heads // prompt_k.shape[1]
    k = torch.cat([prompt_k[row_prompt], comp_k], dim=2).repeat_interleave(rep, dim=1)
    v = torch.cat([prompt_v[row_prompt], comp_v], dim=2).repeat_interleave(rep, dim=1)
    mask = torch.cat([prompt_valid[row_prompt], torch.ones(rows, comp_k.shape[2], dtype=torch.bool)], dim=1)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask[:, None, None, :]).transpose(1, 2)


def test_attention_equals_sdpa_over_each_rows_copy_before_and_after_compaction():
    gen = torch.Generator().manual_seed(0)
    prompts, group, kv_heads, heads, lp, dim, steps = 3, 4, 2, 4, 6, 8, 5
    prompt_valid = torch.ones(prompts, lp, dtype=torch.bool)
    prompt_valid[1, :4] = False  # left padding
    prompt_valid[2, :1] = False
    prefill = BucketedKVCache(num_layers=1, capacity=lp, bucket=1)
    pk, pv = torch.randn(prompts, kv_heads, lp, dim, generator=gen), torch.randn(prompts, kv_heads, lp, dim, generator=gen)
    prefill.update(pk, pv, 0)
    cache = SharedPrefixKVCache(prefill, prompt_valid, group, capacity=steps)
    row_prompt = torch.arange(prompts).repeat_interleave(group)
    ck = torch.empty(prompts * group, kv_heads, 0, dim)
    cv = torch.empty_like(ck)
    for step in range(steps):
        if step == 2:  # compaction: prompt 0 loses all rows, the others keep rows out of order
            keep = torch.tensor([11, 4, 6, 9, 5])
            cache.select_rows(keep)
            row_prompt, ck, cv = row_prompt[keep], ck[keep], cv[keep]
            assert cache.layout.num_prompts == 2 and not cache.layout.identity
        rows = row_prompt.shape[0]
        k_new, v_new = torch.randn(rows, kv_heads, 1, dim, generator=gen), torch.randn(rows, kv_heads, 1, dim, generator=gen)
        keys, values = cache.update(k_new, v_new, 0)
        ck, cv = torch.cat([ck, k_new], 2), torch.cat([cv, v_new], 2)
        query = torch.randn(rows, heads, 1, dim, generator=gen)
        out = cache.attend(0, query, keys, values, dim ** -0.5)
        expected = _reference(query, pk, pv, prompt_valid, row_prompt, ck, cv)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        assert cache.get_seq_length() == lp + step + 1
    # The prompt part is held once per prompt: smaller than the plain cache's G copies.
    assert cache.layers[0].prompt_keys_t.shape[0] == 2


def test_engine_samples_the_same_tokens_and_logprobs_as_the_plain_cache(chaotic, monkeypatch):
    model, tok = chaotic
    calls = []
    attend = SharedPrefixKVCache.attend
    monkeypatch.setattr(SharedPrefixKVCache, "attend", lambda self, *a: calls.append(1) or attend(self, *a))
    stops = list(range(0, len(tok), 3))  # about a third of the tokens stop: rows finish early, the batch compacts
    engine = RolloutEngine(model, tok)
    for settings in (dict(temperature=0), dict(temperature=1.0, seed=3, stop_token_ids=stops)):
        plain, shared = (engine.generate(PROMPTS, SamplingParams(num_generations=4, max_completion_length=24,
                                                                 shared_prefix=flag, **settings))
                         for flag in (False, True))
        assert torch.equal(plain.completion_ids, shared.completion_ids)
        assert torch.equal(plain.completion_mask, shared.completion_mask)
        torch.testing.assert_close(plain.sampling_logprobs, shared.sampling_logprobs, rtol=0, atol=1e-5)
        assert plain.decode_batch_sizes == shared.decode_batch_sizes
    assert len(shared.decode_batch_sizes) > 1  # the stop tokens made it compact
    assert calls and model.config._attn_implementation == "sdpa"  # switched back after decoding


def test_device_default_and_when_the_plain_cache_is_kept(chaotic, monkeypatch):
    model, tok = chaotic
    assert dev.default_shared_prefix_decode("cpu")
    assert not dev.default_shared_prefix_decode("cuda:0") and not dev.default_shared_prefix_decode("npu:0")
    used = []
    monkeypatch.setattr(shared_prefix.SharedPrefixKVCache, "decoding",
                        lambda self, m: used.append(1) or shared_prefix_decoding(m, self))
    engine = RolloutEngine(model, tok)
    engine.generate(PROMPTS[:1], SamplingParams(num_generations=2, max_completion_length=4))
    assert used  # the CPU default
    used.clear()
    engine.generate(PROMPTS[:1], SamplingParams(num_generations=1, max_completion_length=4))
    engine.generate(PROMPTS[:1], SamplingParams(num_generations=2, max_completion_length=4, shared_prefix=False))
    assert not used  # nothing to share with G=1; switched off
    with pytest.raises(ConfigError, match="shared_prefix"):
        SamplingParams(shared_prefix="yes").validate()


def test_models_it_does_not_reproduce_are_detected():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    assert supports_shared_prefix(Qwen2ForCausalLM(Qwen2Config(**small)))
    sliding = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=0, **small))
    assert not supports_shared_prefix(sliding)
    flash = Qwen2ForCausalLM(Qwen2Config(**small))
    flash.config._attn_implementation = "flash_attention_2"
    assert not supports_shared_prefix(flash)


def test_attention_outside_decoding_is_an_error_and_the_implementation_comes_back(chaotic):
    model, _ = chaotic
    with pytest.raises(RuntimeError, match="only valid inside shared_prefix_decoding"):
        shared_prefix.shared_prefix_attention(model.model.layers[0].self_attn, torch.zeros(1, 2, 1, 4),
                                              torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), None)
    prefill = BucketedKVCache(num_layers=1, capacity=2, bucket=1)
    prefill.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    cache = SharedPrefixKVCache(prefill, torch.ones(1, 2, dtype=torch.bool), 2, capacity=3)
    with pytest.raises(ValueError), shared_prefix_decoding(model, cache):
        assert model.config._attn_implementation == shared_prefix.IMPLEMENTATION
        raise ValueError
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="single-token"):
        cache.update(torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 4), 0)


def test_a_decoder_that_bypasses_the_shared_attention_is_stopped():
    """Attention code that reads the cache's keys itself would see only the completions: refused."""
    prefill = BucketedKVCache(num_layers=2, capacity=3, bucket=1)
    for layer in range(2):
        prefill.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), layer)
    cache = SharedPrefixKVCache(prefill, torch.ones(1, 3, dtype=torch.bool), 2, capacity=4)
    step = torch.zeros(2, 1, 1, 4)
    for layer in range(2):  # a step whose layers call attend(): fine
        keys, values = cache.update(step, step, layer)
        cache.attend(layer, torch.zeros(2, 2, 1, 4), keys, values, 0.5)
    for layer in range(2):  # a step whose layers do not
        cache.update(step, step, layer)
    with pytest.raises(RuntimeError, match="shared_prefix=False"):
        cache.update(step, step, 0)
