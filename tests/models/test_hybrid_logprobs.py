"""The log-prob forward on hybrid decoders: a GRPO group's prompt run once (its recurrent states gathered to the
group's rows, models/recurrent_state.py) gives the log-probs and the gradients of every row run whole."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import FAMILIES, hybrid_model
from transformers import AutoTokenizer

from grpo_ascend.models.layer_kinds import layer_kinds
from grpo_ascend.models.policy import CompletionLogprobs
from grpo_ascend.models.recurrent_state import RecurrentStateLayer, prompt_cache


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _rows(vocab: int, prompts: int = 2, group: int = 3):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (prompts, 7), generator=gen).repeat_interleave(group, 0)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[:group, :3] = 0  # the first group's prompt is left-padded
    completion = torch.randint(3, vocab, (prompts * group, 6), generator=gen)
    completion_mask = torch.ones_like(completion)
    completion_mask[1, 4:] = 0
    completion_mask[4, 2:] = 0
    return prompt, prompt_mask, completion, completion_mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shared_prompt_forward_equals_whole_rows_with_gradients(tok, family):
    model = hybrid_model(family, tok).train()
    prompt, prompt_mask, completion, completion_mask = _rows(len(tok))
    results = []
    for share in (True, False):
        model.zero_grad()
        lps, _ = CompletionLogprobs(model, share_prompts=share)(prompt, prompt_mask, completion, completion_mask)
        (lps * completion_mask).sum().backward()
        results.append((lps.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (shared, shared_grads), (whole, whole_grads) = results
    mask = completion_mask.bool()
    torch.testing.assert_close(shared[mask], whole[mask], atol=1e-5, rtol=1e-5)
    assert shared_grads.keys() == whole_grads.keys() and any("A_log" in k for k in whole_grads)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")


def test_prompt_cache_holds_a_recurrent_layer_per_recurrent_layer(tok):
    config = hybrid_model("nemotron_h", tok).config
    kinds = layer_kinds(config)
    assert kinds == ["recurrent", "attention", "stateless", "recurrent", "stateless"]
    cache = prompt_cache(config)
    assert [isinstance(layer, RecurrentStateLayer) for layer in cache.layers] == [k == "recurrent" for k in kinds]
