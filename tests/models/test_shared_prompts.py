"""CompletionLogprobs runs each run of repeated prompts once: same log-probs and gradients as the plain forward."""

from __future__ import annotations

import pytest
import torch

from grpo_ascend import device as dev
from grpo_ascend.models.policy import CompletionLogprobs, apply_peft, default_lora_config, shared_prompt_rows


def _batch(tokenizer, prompts: list[str], repeats: list[int], completion_len: int = 7, seed: int = 0):
    """Left-padded prompts repeated per ``repeats`` and random right-padded completions."""
    enc = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    width = max(len(e) for e in enc)
    rows = [e for e, r in zip(enc, repeats) for _ in range(r)]
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(e)) + e for e in rows])
    prompt_mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in rows])
    gen = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(3, 60, (len(rows), completion_len), generator=gen)
    lengths = torch.randint(1, completion_len + 1, (len(rows),), generator=gen)
    completion_mask = (torch.arange(completion_len)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


PROMPTS = ["3+4=", "12+7= ", "9+9=", "1+20+3="]


def test_shared_prompt_rows_finds_runs_of_identical_prompts(tiny_model):
    _, tok = tiny_model
    ids, mask, _, _ = _batch(tok, PROMPTS, [3, 1, 2, 2])
    first, row_run = shared_prompt_rows(ids, mask)
    assert first.tolist() == [0, 3, 4, 6]
    assert row_run.tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    distinct, *_ = _batch(tok, PROMPTS, [1, 1, 1, 1])
    assert shared_prompt_rows(distinct, torch.ones_like(distinct)) is None
    # Equal prompts that are not adjacent are not merged (rows stay in the caller's order).
    alternating = torch.cat([distinct[:2], distinct[:2]])
    assert shared_prompt_rows(alternating, torch.ones_like(alternating)) is None


@pytest.mark.parametrize("repeats", [[4, 4], [3, 1, 2, 2], [1, 5, 1, 1]])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_shared_forward_matches_plain_forward_and_gradients(tiny_model, repeats, with_entropy):
    model, tok = tiny_model
    torch.manual_seed(0)
    policy = apply_peft(model, default_lora_config(r=4))
    for name, p in policy.named_parameters():
        if "lora_B" in name:  # non-zero B so the adapters change the outputs and get gradients
            torch.nn.init.normal_(p, std=0.05)
    inputs = _batch(tok, PROMPTS[: len(repeats)], repeats)
    results = []
    for share in (True, False):
        lp = CompletionLogprobs(policy, chunk_size=5, share_prompts=share)
        policy.zero_grad(set_to_none=True)
        logps, ent = lp(*inputs, temperature=0.7, with_entropy=with_entropy)
        mask = inputs[3].float()
        loss = (logps * mask).sum() + (0 if ent is None else (ent * mask).sum() * 0.1)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((logps.detach(), None if ent is None else ent.detach(), grads))
    (shared_lp, shared_ent, shared_g), (plain_lp, plain_ent, plain_g) = results
    mask = inputs[3].bool()
    torch.testing.assert_close(shared_lp[mask], plain_lp[mask], rtol=0, atol=2e-5)
    if with_entropy:
        torch.testing.assert_close(shared_ent[mask], plain_ent[mask], rtol=0, atol=2e-5)
    assert shared_g.keys() == plain_g.keys() and len(plain_g) > 0
    for name in plain_g:
        torch.testing.assert_close(shared_g[name], plain_g[name], rtol=1e-4, atol=1e-5, msg=name)


def test_shared_forward_with_adapters_disabled_matches_base(tiny_model):
    """The reference pass (adapters off) also shares prompts and equals the base model's log-probs."""
    from grpo_ascend.models.parameters import adapters_disabled

    model, tok = tiny_model
    inputs = _batch(tok, PROMPTS[:2], [4, 4])
    with torch.no_grad():
        base = CompletionLogprobs(model, share_prompts=False)(*inputs)[0]
        policy = apply_peft(model, default_lora_config(r=4))
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
        with adapters_disabled(policy):
            ref = CompletionLogprobs(policy)(*inputs)[0]
        adapted = CompletionLogprobs(policy)(*inputs)[0]
    mask = inputs[3].bool()
    torch.testing.assert_close(ref[mask], base[mask], rtol=0, atol=2e-5)
    assert (adapted[mask] - base[mask]).abs().max() > 1e-3


def test_gradient_checkpointing_uses_the_plain_forward(tiny_model, monkeypatch):
    model, tok = tiny_model
    model.train()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    try:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    import grpo_ascend.models.policy as models

    monkeypatch.setattr(models, "shared_prompt_rows", lambda *a, **k: calls.append(1))
    inputs = _batch(tok, PROMPTS[:2], [4, 4])
    logps, _ = CompletionLogprobs(model)(*inputs)
    assert calls == [] and logps.shape == inputs[2].shape


def _order(micro: int, accum: int, G: int, n: int, seed: int = 0, round_index: int = 0):
    from types import SimpleNamespace

    from grpo_ascend.trainers.micro_batches import round_row_order

    plan = SimpleNamespace(micro_batch=micro, grad_accum=accum, num_generations=G)
    return round_row_order(n, plan, seed, round_index, 0, torch.device("cpu"))


def test_rounds_shuffle_whole_groups_when_steps_hold_whole_groups():
    order = _order(micro=4, accum=2, G=4, n=32)
    assert sorted(order.tolist()) == list(range(32))
    groups = order.view(-1, 4)
    assert (groups == groups[:, :1] + torch.arange(4)).all()  # each group's rows adjacent, in order
    assert groups[:, 0].tolist() != sorted(groups[:, 0].tolist())  # ... and the groups shuffled
    assert torch.equal(order, _order(micro=4, accum=2, G=4, n=32))  # seeded: resume replays it
    assert not torch.equal(order, _order(micro=4, accum=2, G=4, n=32, round_index=1))


def test_rounds_shuffle_rows_when_a_step_would_split_a_group():
    order = _order(micro=3, accum=1, G=4, n=24)
    assert sorted(order.tolist()) == list(range(24))
    assert not (order.view(-1, 4) == order.view(-1, 4)[:, :1] + torch.arange(4)).all()


def test_shared_forward_under_bf16_autocast(tiny_model):
    model, tok = tiny_model
    inputs = _batch(tok, PROMPTS[:2], [4, 4])
    mask = inputs[3].bool()
    with torch.no_grad():
        exact = CompletionLogprobs(model, share_prompts=False)(*inputs)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            shared = CompletionLogprobs(model)(*inputs)[0]
            plain = CompletionLogprobs(model, share_prompts=False)(*inputs)[0]
    assert shared.dtype == torch.float32
    # bf16 rounding: the shared path is as close to fp32 as the plain bf16 forward is
    shared_err = (shared[mask] - exact[mask]).abs().mean()
    plain_err = (plain[mask] - exact[mask]).abs().mean()
    assert shared_err < 2 * plain_err + 1e-3, (shared_err, plain_err)


def test_critic_values_share_prompts_with_the_same_result(tiny_model):
    from grpo_ascend.models.critic import active_adapter, build_critic, enable_critic_grads

    model, tok = tiny_model
    policy = apply_peft(model, default_lora_config(r=4))
    critic = build_critic(policy, "policy", None)
    enable_critic_grads(critic)
    with torch.no_grad():
        critic.module.head.weight.normal_(0, 0.5)  # a non-trivial value head and critic adapter
        for p in critic.trainable:
            if p.dim() == 2:
                p.normal_(0, 0.05)
    inputs = _batch(tok, PROMPTS[:3], [3, 2, 3])
    out = []
    for share in (True, False):
        critic.module.share_prompts = share
        for p in critic.trainable:
            p.grad = None
        with active_adapter(policy, critic.adapter):
            values = critic.module(*inputs)
            (values * inputs[3]).sum().backward()
        out.append((values.detach(), [p.grad.clone() for p in critic.trainable if p.grad is not None]))
    mask = inputs[3].bool()
    torch.testing.assert_close(out[0][0][mask], out[1][0][mask], rtol=0, atol=2e-5)
    assert len(out[0][1]) == len(out[1][1]) > 0
    for a, b in zip(out[0][1], out[1][1]):  # float32 sums in another order: relative to the gradient's scale
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_completions_cut_after_the_longest_give_the_uncut_logprobs_and_gradients(tiny_model, with_entropy,
                                                                                   monkeypatch):
    """Columns that are padding in every row are dropped before the forward and come back as zeros."""
    from grpo_ascend.models.policy import used_completion_width

    model, tok = tiny_model
    torch.manual_seed(0)
    policy = apply_peft(model, default_lora_config(r=4))
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    prompt_ids, prompt_mask, ids, mask = _batch(tok, PROMPTS, [2, 2, 2, 2], completion_len=7)
    longest = int(mask.sum(1).max())
    ids = torch.nn.functional.pad(ids, (0, 6), value=tok.pad_token_id)  # 6 + (7 - longest) unused columns
    mask = torch.nn.functional.pad(mask, (0, 6))
    inputs = (prompt_ids, prompt_mask, ids, mask)
    assert used_completion_width(mask) == longest < ids.shape[1]
    lp = CompletionLogprobs(policy, chunk_size=5)
    results = []
    for cut in (True, False):
        with monkeypatch.context() as scoped:
            if not cut:  # a length bucket as wide as the completions: the same forward, nothing cut
                scoped.setattr(dev, "default_length_bucket", lambda device: ids.shape[1])
                assert used_completion_width(mask) == ids.shape[1]
            policy.zero_grad(set_to_none=True)
            logps, ent = lp(*inputs, temperature=0.7, with_entropy=with_entropy)
            loss = (logps * mask).sum() + (0 if ent is None else (ent * mask).sum() * 0.1)
            loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((logps.detach(), None if ent is None else ent.detach(), grads))
    (cut_lp, cut_ent, cut_g), (full_lp, full_ent, full_g) = results
    assert cut_lp.shape == full_lp.shape == ids.shape
    keep = mask.bool()
    torch.testing.assert_close(cut_lp[keep], full_lp[keep], rtol=0, atol=1e-6)
    assert (cut_lp[:, longest:] == 0).all()
    if with_entropy:
        assert cut_ent.shape == ids.shape and (cut_ent[:, longest:] == 0).all()
        torch.testing.assert_close(cut_ent[keep], full_ent[keep], rtol=0, atol=1e-6)
    assert cut_g.keys() == full_g.keys() and len(full_g) > 0
    for name in full_g:
        torch.testing.assert_close(cut_g[name], full_g[name], rtol=1e-4, atol=1e-5, msg=name)
    empty = torch.zeros_like(mask)
    assert used_completion_width(empty) == 1
    assert used_completion_width(mask[:, :0]) == 0
