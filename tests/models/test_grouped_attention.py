"""Grouped batched-matmul attention of the log-prob forwards: SDPA's results, SDPA's fallbacks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grpo_ascend import device as dev
from grpo_ascend.models import grouped_attention
from grpo_ascend.models.grouped_attention import IMPLEMENTATION, grouped_attention_forward
from grpo_ascend.models.policy import CompletionLogprobs


class _Module(nn.Module):
    """What the attention functions read off a transformers attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(rows=3, heads=4, kv_heads=2, queries=5, keys=9, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, requires_grad=True)  # noqa: E731
    return make(rows, heads, queries, dim), make(rows, kv_heads, keys, dim), make(rows, kv_heads, keys, dim)


def _padding_mask(rows, queries, keys, padding):
    """SDPA's boolean mask: causal over the last ``queries`` keys, each row's first ``padding[r]`` keys masked."""
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    valid = torch.arange(keys).unsqueeze(0) >= torch.tensor(padding).unsqueeze(1)
    return causal & valid[:, None, None, :]


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_equals_sdpa_with_a_padding_mask_outputs_and_gradients(heads, kv_heads):
    query, key, value = _inputs(heads=heads, kv_heads=kv_heads)
    mask = _padding_mask(3, 5, 9, padding=[0, 2, 7])  # row 2: its first query sees only padding
    module = _Module(heads // kv_heads)
    ours, _ = grouped_attention_forward(module, query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (3, 5, heads, 8)
    valid = mask[:, 0].any(-1)  # [rows, queries]: queries that attend to at least one key
    assert not valid.all()
    torch.testing.assert_close(ours[valid], theirs[valid], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(ours).all()  # a query that sees only padding gets finite (uniform) weights

    weight = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1)) * valid[:, :, None, None]
    grads = [torch.autograd.grad((out * weight).sum(), (query, key, value)) for out in (ours, theirs)]
    for g_ours, g_theirs in zip(*grads):
        assert torch.isfinite(g_ours).all()
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-6)


def test_equals_sdpa_without_a_mask_causal_and_not_and_with_an_additive_mask():
    query, key, value = _inputs(queries=6, keys=6)
    module = _Module(2)
    for causal in (True, False):
        ours, _ = grouped_attention_forward(module, query, key, value, None, is_causal=causal)
        theirs, _ = sdpa_attention_forward(module, query, key, value, None, is_causal=causal)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    additive = torch.randn(3, 1, 6, 6, generator=torch.Generator().manual_seed(2))
    ours, _ = grouped_attention_forward(module, query, key, value, additive)
    theirs, _ = sdpa_attention_forward(module, query, key, value, additive)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_large_blocks_dropout_and_half_precision_go_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(grouped_attention, "grouped_softmax_attention",
                        lambda *a: calls.append(a) or torch.zeros(()))
    query, key, value = _inputs()
    module = _Module(2)
    mask = _padding_mask(3, 5, 9, padding=[0, 0, 0])
    block = 3 * 4 * 5 * 9 * 4  # bytes of the float32 probabilities
    monkeypatch.setattr(dev, "grouped_attention_max_bytes", lambda device: block - 1)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask)
    torch.testing.assert_close(grouped_attention_forward(module, query, key, value, mask)[0], reference)
    grouped_attention_forward(module, query, key, value, mask, dropout=0.1)
    half = [t.detach().to(torch.bfloat16) for t in (query, key, value)]
    monkeypatch.setattr(dev, "grouped_attention_max_bytes", lambda device: block)
    grouped_attention_forward(module, *half, mask)
    assert calls == []
    grouped_attention_forward(module, query, key, value, mask)
    assert len(calls) == 1


def test_device_budget_is_for_the_cpu_only():
    assert dev.grouped_attention_max_bytes("cpu") == 8 << 20
    for kind in ("cuda", "npu"):
        assert dev.grouped_attention_max_bytes(kind) == 0


def _batch(vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (2, 7), generator=gen).repeat_interleave(3, 0)  # 2 groups of 3
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[:3, :4] = 0  # the first group's prompt is left-padded
    completion = torch.randint(3, vocab, (6, 5), generator=gen)
    completion_mask = torch.ones_like(completion)
    completion_mask[1, 3:] = 0
    return prompt, prompt_mask, completion, completion_mask


def test_log_prob_forward_uses_it_and_equals_sdpa(chaotic, monkeypatch):
    model, _ = chaotic
    model.requires_grad_(True)
    batch = _batch(model.config.vocab_size)
    calls = []
    attend = grouped_attention.grouped_softmax_attention
    monkeypatch.setattr(grouped_attention, "grouped_softmax_attention", lambda *a: calls.append(1) or attend(*a))
    results = {}
    for name, budget in (("grouped", 8 << 20), ("sdpa", 0)):
        monkeypatch.setattr(dev, "grouped_attention_max_bytes", lambda device, budget=budget: budget)
        logps, _ = CompletionLogprobs(model)(*batch)
        (logps * batch[3]).sum().backward()
        results[name] = logps.detach(), [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        assert model.config._attn_implementation == "sdpa"  # switched back after the forward
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * layers  # the shared prompts' prefill and the completions, every layer
    mask = batch[3].bool()
    torch.testing.assert_close(results["grouped"][0][mask], results["sdpa"][0][mask], rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(results["grouped"][1], results["sdpa"][1]):
        assert (ours - theirs).norm() <= 1e-5 * theirs.norm() + 1e-9  # float rounding, element-wise noise


def test_no_switch_under_activation_checkpointing_or_other_implementations(chaotic, monkeypatch):
    model, _ = chaotic
    with grouped_attention.grouped_attention(model) as switched:
        assert switched and model.config._attn_implementation == IMPLEMENTATION
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(grouped_attention, "activation_checkpointing_on", lambda m: True)
    with grouped_attention.grouped_attention(model) as switched:
        assert not switched and model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(grouped_attention, "activation_checkpointing_on", lambda m: False)
    monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    with grouped_attention.grouped_attention(model) as switched:
        assert not switched and model.config._attn_implementation == "eager"
    monkeypatch.undo()
    with pytest.raises(ValueError), grouped_attention.grouped_attention(model):
        raise ValueError("a forward that fails")
    assert model.config._attn_implementation == "sdpa"
