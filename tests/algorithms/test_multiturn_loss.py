"""Tool-response tokens are context, never loss: for every registered loss type they add nothing to
the loss, the gradient, the KL or any token count, and micro-batch accumulation stays exact."""

from __future__ import annotations

import types

import pytest
import torch

from grpo_ascend.algorithms.losses import (
    POLICY_LOSSES,
    LossNormaliser,
    PolicyLossBatch,
    PolicyLossSettings,
    policy_loss,
)
from grpo_ascend.experience import completions_for_rewards, rollout_loss_mask, tool_counts

B, T = 6, 12
SETTINGS = dict(beta=0.05, entropy_coef=0.01, delta=2.0, max_completion_length=T, epsilon_high=0.28)


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    old = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    lengths = torch.tensor([12, 9, 5, 12, 3, 7])
    context = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    tool = torch.ones(B, T, dtype=torch.long)
    tool[0, 3:6] = 0  # tool responses in the middle of rows 0, 1 and 3
    tool[1, 2:4] = 0
    tool[3, 5:11] = 0
    batch = types.SimpleNamespace(completion_mask=context, tool_mask=tool * context, truncated=torch.zeros(B, dtype=torch.bool))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 1.2, -0.3], dtype=torch.float64)
    return dict(logps=logps, old=old, ref=ref, ent=ent, adv=adv), rollout_loss_mask(batch).double(), batch


def _loss(loss_type, d, mask, rows=slice(None), normaliser=None, level="token"):
    logps = d["logps"].clone().requires_grad_(True)
    ent = d["ent"].clone().requires_grad_(True)
    batch = PolicyLossBatch(logps=logps[rows], advantages=d["adv"][rows], mask=mask[rows], old_logps=d["old"][rows],
                            ref_logps=d["ref"][rows], entropies=ent[rows])
    loss, stats = policy_loss(loss_type, batch, PolicyLossSettings(importance_sampling_level=level, **SETTINGS),
                              normaliser)
    loss.backward()
    return loss.detach(), stats, logps.grad, ent.grad


def _compact(d, mask):
    """The same rows with the tool tokens removed (valid tokens moved left, padding after)."""
    out = {k: v.clone() for k, v in d.items()}
    new_mask = torch.zeros_like(mask)
    for i in range(B):
        keep = mask[i].bool()
        n = int(keep.sum())
        for k in ("logps", "old", "ref", "ent"):
            out[k][i, :n] = d[k][i, keep]
            out[k][i, n:] = d[k][i, ~keep]
        new_mask[i, :n] = 1
    return out, new_mask


def test_loss_mask_is_context_times_tool_mask():
    d, mask, batch = _data()
    assert mask[0].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert mask[3].tolist() == [1] * 5 + [0] * 6 + [1]
    assert mask.sum() == batch.completion_mask.sum() - 11
    batch.truncated[2] = True
    assert rollout_loss_mask(batch, mask_truncated_completions=True)[2].sum() == 0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", POLICY_LOSSES.names())
def test_tool_tokens_add_nothing_to_loss_gradient_or_counts(loss_type, level):
    d, mask, _ = _data()
    loss, stats, grad, ent_grad = _loss(loss_type, d, mask, level=level)
    hole = (mask == 0)
    assert (grad[hole] == 0).all() and (ent_grad[hole] == 0).all()
    assert grad[~hole].abs().sum() > 0
    # Junk at tool positions changes nothing.
    junk = {k: torch.where(hole, torch.full_like(v, 7.0 if k != "logps" else -50.0), v) if v.dim() == 2 else v
            for k, v in d.items()}
    loss2, stats2, grad2, _ = _loss(loss_type, junk, mask, level=level)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    torch.testing.assert_close(grad2, grad, rtol=0, atol=0)
    # The same as a batch where the tool tokens are not there at all.
    compact, cmask = _compact(d, mask)
    loss3, stats3, grad3, _ = _loss(loss_type, compact, cmask, level=level)
    torch.testing.assert_close(loss3, loss, rtol=1e-12, atol=1e-12)
    for i in range(B):
        torch.testing.assert_close(grad3[i, : int(cmask[i].sum())], grad[i][mask[i].bool()], rtol=1e-12, atol=1e-12)
    assert stats["token_count"].item() == mask.sum().item() == stats3["token_count"].item()
    torch.testing.assert_close(stats["kl_sum"], stats3["kl_sum"])


@pytest.mark.parametrize("loss_type", POLICY_LOSSES.names())
def test_accumulation_with_tool_tokens_is_exact(loss_type):
    d, mask, _ = _data()
    norm = LossNormaliser.for_step(mask)
    full, _, grad, _ = _loss(loss_type, d, mask, normaliser=norm)
    total, grads = torch.zeros((), dtype=torch.float64), torch.zeros_like(grad)
    for s in range(0, B, 2):
        part, _, g, _ = _loss(loss_type, d, mask, rows=slice(s, s + 2), normaliser=norm)
        total, grads = total + part, grads + g
    torch.testing.assert_close(total, full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads, grad, rtol=1e-10, atol=1e-12)


def test_rewards_see_whole_conversations_and_tool_counts_sum():
    messages = [[{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "name": "f", "content": "1"},
                 {"role": "assistant", "content": "one"}], [{"role": "assistant", "content": "x"}]]
    batch = types.SimpleNamespace(completion_texts=["a", "b"], messages=messages,
                                  tool_metrics={"tools/calls_per_completion": 0.5, "tools/turns_per_completion": 1.5,
                                                "tools/time_s": 0.25, "tools/failed/timeout": 1.0,
                                                "tools/failed_calls": 1.0})
    assert completions_for_rewards(batch, conversational=True) == messages
    assert completions_for_rewards(batch, conversational=False) == ["a", "b"]
    assert tool_counts(batch) == {"tools/calls": 1.0, "tools/turns": 3.0, "tools/completions": 2.0, "tools/time_s": 0.25,
                                  "tools/failed/timeout": 1.0, "tools/failed_calls": 1.0}
