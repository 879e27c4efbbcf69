"""Vectorised GAE against straightforward reverse loops; whitening."""

from __future__ import annotations

import pytest
import torch

from grpo_ascend.algorithms.gae import discounted_reverse_cumsum, gae_advantages, gae_advantages_env, whiten
from grpo_ascend.errors import ConfigError, DataError

COEFFS = [(0.99, 0.95), (1.0, 1.0), (1.0, 0.0), (0.9, 1.0), (0.5, 0.1), (0.0, 0.95)]


def loop_gae_batch(rewards, values, mask, gamma, lam):
    """Right-padded rows; the value after the last valid token is 0."""
    batch, length = rewards.shape
    adv = torch.zeros_like(rewards)
    for b in range(batch):
        last = 0.0
        for t in reversed(range(length)):
            if not mask[b, t]:
                last = 0.0
                continue
            next_v = values[b, t + 1] if t + 1 < length and mask[b, t + 1] else 0.0
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, (adv + values) * mask


def loop_gae_env(rewards, values, dones, next_value, gamma, lam):
    steps = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(steps)):
        nonterminal = 1.0 - dones[t]
        next_v = next_value if t == steps - 1 else values[t + 1]
        delta = rewards[t] + gamma * next_v * nonterminal - values[t]
        last = delta + gamma * lam * nonterminal * last
        adv[t] = last
    return adv, adv + values


def batch_data(batch, length, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=g, dtype=dtype)
    values = torch.randn(batch, length, generator=g, dtype=dtype)
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length) < lengths.unsqueeze(1)).to(dtype)
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", COEFFS)
@pytest.mark.parametrize("length", [1, 7, 64, 200, 512])
def test_batch_layout_matches_loop_float64(gamma, lam, length):
    rewards, values, mask = batch_data(3, length, torch.float64, seed=length)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = loop_gae_batch(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0)])
def test_batch_layout_float32(gamma, lam):
    rewards, values, mask = batch_data(4, 512, torch.float64, seed=1)
    adv, ret = gae_advantages(rewards.float(), values.float(), mask.float(), gamma, lam)
    ref_adv, ref_ret = loop_gae_batch(rewards, values, mask, gamma, lam)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma,lam", COEFFS)
@pytest.mark.parametrize("steps", [1, 16, 130, 512])
def test_env_layout_matches_loop(gamma, lam, steps):
    g = torch.Generator().manual_seed(steps)
    rewards = torch.randn(steps, 5, generator=g, dtype=torch.float64)
    values = torch.randn(steps, 5, generator=g, dtype=torch.float64)
    dones = (torch.rand(steps, 5, generator=g) < 0.05).to(torch.float64)
    dones[:, 1] = 0  # one env never ends
    dones[-1, 2] = 1  # one ends exactly at the last step
    next_value = torch.randn(5, generator=g, dtype=torch.float64)
    adv, ret = gae_advantages_env(rewards, values, dones, next_value, gamma, lam)
    ref_adv, ref_ret = loop_gae_env(rewards, values, dones, next_value, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-6)


def test_env_layout_float32_and_bool_dones():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(300, 3, generator=g, dtype=torch.float64) * 0.1
    values = torch.rand(300, 3, generator=g, dtype=torch.float64) * 0.1
    dones = torch.rand(300, 3, generator=g) < 0.02
    next_value = torch.rand(3, generator=g, dtype=torch.float64)
    adv, _ = gae_advantages_env(rewards.float(), values.float(), dones, next_value.float(), 0.99, 0.95)
    ref_adv, _ = loop_gae_env(rewards, values, dones.double(), next_value, 0.99, 0.95)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [2, 3, 64])
def test_reverse_cumsum_chunking_and_stops(chunk):
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(2, 3, 100, generator=g, dtype=torch.float64)
    stops = torch.rand(2, 3, 100, generator=g) < 0.1
    for disc in (0.0, 0.3, 0.97, 1.0):
        y = discounted_reverse_cumsum(x, disc, stops, chunk_size=chunk)
        ref = torch.zeros_like(x)
        carry = torch.zeros(2, 3, dtype=torch.float64)
        for t in reversed(range(100)):
            carry = x[..., t] + disc * (~stops[..., t]).double() * carry
            ref[..., t] = carry
        torch.testing.assert_close(y, ref, rtol=0, atol=1e-9)


def test_small_discount_long_sequence_has_no_overflow():
    x = torch.ones(1, 512, dtype=torch.float32)
    y = discounted_reverse_cumsum(x, 0.05)
    assert torch.isfinite(y).all()
    remaining = torch.arange(512, 0, -1, dtype=torch.float64)
    expected = (1 - 0.05**remaining) / 0.95  # geometric series with 512 − t terms
    torch.testing.assert_close(y[0].double(), expected, rtol=1e-6, atol=1e-6)


def test_whiten():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64) * 3 + 2
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [4]])).to(torch.float64)
    vals = x[mask.bool()]
    out = whiten(x, mask)
    ref = (vals - vals.mean()) / torch.sqrt(vals.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(out[mask.bool()], ref)
    assert (out[~mask.bool()] == 0).all()
    torch.testing.assert_close(whiten(x, mask, shift_mean=False)[mask.bool()], ref + vals.mean())
    torch.testing.assert_close(whiten(vals), ref)


def _two_ranks(fn):
    """``fn(rank, reduce)`` run by two threads as two ranks; ``reduce`` sums a tensor over both, as an all-reduce."""
    import threading

    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def reduce_for(rank):
        def reduce(t):
            slots[rank] = t
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read the slots before either writes the next
            return total

        return reduce

    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(r, reduce_for(r)))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_whiten_with_a_reduce_whitens_over_every_ranks_entries():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64) * 2 + 1
    mask = (torch.arange(5) < torch.tensor([[[5], [2], [0]], [[3], [4], [1]]])).to(torch.float64)
    per_rank = _two_ranks(lambda r, reduce: whiten(x[r], mask[r], reduce=reduce))
    torch.testing.assert_close(torch.cat(per_rank), whiten(x.reshape(6, 5), mask.reshape(6, 5)), rtol=1e-12, atol=1e-12)
    assert torch.equal(whiten(x[0], mask[0], reduce=lambda t: t), whiten(x[0], mask[0]))  # one rank: identical


def test_ppo_token_advantages_and_their_statistics_against_a_direct_computation():
    from grpo_ascend.algorithms.kl_control import token_rewards
    from grpo_ascend.algorithms.token_advantages import TOKEN_ADVANTAGE_ESTIMATORS, gae_token_advantages

    assert TOKEN_ADVANTAGE_ESTIMATORS.get("gae") is gae_token_advantages
    g = torch.Generator().manual_seed(2)
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [4]])).float()
    logps, ref = -torch.rand(4, 6, generator=g) * 2, -torch.rand(4, 6, generator=g) * 2
    values, scores = torch.randn(4, 6, generator=g) * mask, torch.tensor([1.0, 0.0, 0.5, -1.0])
    beta, gamma, lam = 0.1, 0.99, 0.95
    out = gae_token_advantages(scores, logps, ref, values, mask, beta, gamma, lam)
    rewards, kl = token_rewards(scores, logps, ref, mask, beta)
    raw, returns = (t.float() for t in loop_gae_batch(rewards.double(), values.double(), mask.double(), gamma, lam))
    torch.testing.assert_close(out.raw_advantages, raw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.returns, returns, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.advantages, whiten(out.raw_advantages, mask))
    assert torch.equal(gae_token_advantages(scores, logps, ref, values, mask, beta, gamma, lam, False).advantages,
                       out.raw_advantages)

    metrics, sequences = out.metrics(values, mask, reduce=lambda t: t, gather=lambda t: t)
    n, valid = mask.sum().item(), mask.bool()
    err = (out.returns - values)[valid]
    assert sequences == 4
    assert metrics["kl"] == pytest.approx(kl.sum().item() / n, rel=1e-6)
    assert metrics["kl/sequence"] == pytest.approx(kl.sum(1).mean().item(), rel=1e-6)
    assert metrics["kl_coef"] == beta
    assert metrics["non_score_reward"] == pytest.approx(-beta * kl.sum().item() / 4, rel=1e-6)
    assert metrics["returns/mean"] == pytest.approx(out.returns.sum().item() / n, rel=1e-6)
    assert metrics["advantages/mean"] == pytest.approx(raw.sum().item() / n, rel=1e-5, abs=1e-7)
    expected_ev = 1 - err.var(unbiased=False).item() / out.returns[valid].var(unbiased=False).item()
    assert metrics["explained_variance"] == pytest.approx(expected_ev, rel=1e-4)


def test_errors():
    r = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match="gamma"):
        gae_advantages(r, r, r, gamma=1.5)
    with pytest.raises(ConfigError, match="lam"):
        gae_advantages(r, r, r, lam=-0.1)
    with pytest.raises(DataError, match="values has shape"):
        gae_advantages(r, torch.zeros(2, 4), r)
    with pytest.raises(ConfigError, match="chunk_size"):
        discounted_reverse_cumsum(r, 0.9, chunk_size=1)
    with pytest.raises(DataError, match="next_value"):
        gae_advantages_env(r, r, r, torch.zeros(2))
