"""Policy/value losses against loop references written from the published formulas."""

from __future__ import annotations

import math

import pytest
import torch
from reference_losses import EPS, EPS_HIGH, MAX_LEN, make_data, reference_loss

from grpo_ascend.algorithms.losses import (
    POLICY_LOSSES,
    LossNormaliser,
    PolicyLossBatch,
    PolicyLossSettings,
    policy_loss,
    ppo_policy_loss,
    ppo_value_loss,
)
from grpo_ascend.errors import ConfigError, DataError

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def ours(loss_type, d, logps, ent, normaliser=None, rows=slice(None), **kw):
    settings = PolicyLossSettings(
        epsilon=EPS, epsilon_high=kw.pop("eps_high", EPS_HIGH), max_completion_length=MAX_LEN, **kw
    )
    batch = PolicyLossBatch(
        logps=logps[rows],
        advantages=d["adv"][rows],
        mask=d["mask"][rows],
        old_logps=d["old"][rows],
        ref_logps=d["ref"][rows],
        entropies=ent[rows],
    )
    return policy_loss(loss_type, batch, settings, normaliser)


CASES = [
    {},
    {"delta": 2.0},
    {"beta": 0.04},
    {"ent_coef": 0.01},
    {"delta": 2.0, "beta": 0.1, "ent_coef": 0.02},
    {"level": "sequence"},
    {"level": "sequence", "beta": 0.05, "ent_coef": 0.01, "delta": 1.5},
]


def _kw(case):
    kw = dict(case)
    out = {}
    if "level" in kw:
        out["importance_sampling_level"] = kw["level"]
    for k in ("delta", "beta"):
        if k in kw:
            out[k] = kw[k]
    if "ent_coef" in kw:
        out["entropy_coef"] = kw["ent_coef"]
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_value_and_gradient_match_reference(loss_type, case):
    d = make_data()
    lp1 = d["logps"].clone().requires_grad_(True)
    en1 = d["ent"].clone().requires_grad_(True)
    loss, _ = ours(loss_type, d, lp1, en1, **_kw(case))
    loss.backward()

    lp2 = d["logps"].clone().requires_grad_(True)
    en2 = d["ent"].clone().requires_grad_(True)
    ref = reference_loss(loss_type, d, lp2, en2, **case)
    ref.backward()

    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(en1.grad, en2.grad, rtol=1e-10, atol=1e-12)
    assert torch.isfinite(lp1.grad).all()
    assert (lp1.grad[d["mask"] == 0] == 0).all()


def test_gspo_matches_sequence_level_objective():
    """GSPO paper: J = 1/G Σ_i min(s_i A_i, clip(s_i, 1−ε, 1+ε_high) A_i)."""
    d = make_data()
    lp1 = d["logps"].clone().requires_grad_(True)
    loss, _ = ours("grpo", d, lp1, d["ent"], importance_sampling_level="sequence", eps_high=3e-4 + 1e-4)
    loss.backward()

    lp2 = d["logps"].clone().requires_grad_(True)
    terms = []
    for i in range(8):
        m = d["mask"][i]
        if m.sum() == 0:
            terms.append(torch.zeros((), dtype=torch.float64))
            continue
        s = torch.exp(((lp2[i] - torch.where(m.bool(), d["old"][i], lp2[i].detach())) * m).sum() / m.sum())
        a = d["adv"][i]
        terms.append(torch.minimum(s * a, torch.clamp(s, 1 - EPS, 1 + 4e-4) * a))
    ref = -torch.stack(terms).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradient_accumulation_is_exact(loss_type, level):
    d = make_data()
    kw = {"importance_sampling_level": level, "beta": 0.05, "entropy_coef": 0.01, "delta": 2.0}
    norm = LossNormaliser.for_step(d["mask"])

    lp_full = d["logps"].clone().requires_grad_(True)
    full, _ = ours(loss_type, d, lp_full, d["ent"], normaliser=norm, **kw)
    full.backward()

    lp_acc = d["logps"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    stats_sum: dict[str, torch.Tensor] = {}
    for start in range(0, 8, 2):
        loss, stats = ours(
            loss_type, d, lp_acc, d["ent"], normaliser=norm, rows=slice(start, start + 2), **kw
        )
        loss.backward()
        total = total + loss.detach()
        for k, v in stats.items():
            stats_sum[k] = stats_sum.get(k, 0) + v
    torch.testing.assert_close(total, full.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lp_acc.grad, lp_full.grad, rtol=1e-5, atol=1e-7)
    _, full_stats = ours(loss_type, d, d["logps"], d["ent"], normaliser=norm, **kw)
    for k, v in full_stats.items():
        torch.testing.assert_close(stats_sum[k], v)


def test_stats_are_exact_sums():
    d = make_data()
    settings_kw = {"beta": 0.1, "delta": 2.0}
    _, stats = ours("bnpo", d, d["logps"], d["ent"], **settings_kw)
    low = high = tokens = 0
    ratio_sum = kl_sum = ent_sum = 0.0
    for i in range(8):
        for t in range(6):
            if d["mask"][i, t] == 0:
                continue
            r = math.exp(d["logps"][i, t] - d["old"][i, t])
            a = float(d["adv"][i])
            low += r < 1 - EPS and a < 0
            high += r > 1 + EPS_HIGH and a > 0
            tokens += 1
            ratio_sum += r
            x = float(d["ref"][i, t] - d["logps"][i, t])
            kl_sum += math.exp(x) - x - 1
            ent_sum += float(d["ent"][i, t])
    assert low > 0 and high > 0
    assert stats["clipped_low"].item() == low
    assert stats["clipped_high"].item() == high
    assert stats["clipped_region"].item() == low + high
    assert stats["token_count"].item() == tokens
    assert stats["ratio_sum"].item() == pytest.approx(ratio_sum)
    assert stats["kl_sum"].item() == pytest.approx(kl_sum)
    assert stats["entropy_sum"].item() == pytest.approx(ent_sum)
    assert all(not v.requires_grad for v in stats.values())


def test_old_logps_none_means_ratio_one():
    d = make_data()
    logps = d["logps"].clone().requires_grad_(True)
    batch = PolicyLossBatch(logps=logps, advantages=d["adv"], mask=d["mask"])
    loss, stats = policy_loss("bnpo", batch, PolicyLossSettings())
    loss.backward()
    m = d["mask"]
    expected = -(d["adv"].unsqueeze(1) * m).sum() / m.sum()
    torch.testing.assert_close(loss, expected)
    # d/dlogp of −r·A with r = exp(logp − sg[logp]) is −A per valid token / token count.
    torch.testing.assert_close(logps.grad, -(d["adv"].unsqueeze(1) * m) / m.sum())
    assert stats["ratio_sum"].item() == pytest.approx(m.sum().item())


def test_dapo_normaliser_spans_steps_and_ranks():
    d = make_data()
    # Two ranks × two optimizer steps; this rank's step holds `mask`; the generation batch has
    # 100 valid tokens in total → 25 per rank per step.
    norm = LossNormaliser.for_step(
        d["mask"], generation_tokens_global=100, steps_per_generation=2, world_size=2
    )
    assert norm.num_tokens_per_step_global == 25
    assert norm.num_sequences == 8
    loss, _ = ours("dapo", d, d["logps"], d["ent"], normaliser=norm)
    token_mean = reference_loss("bnpo", d, d["logps"], d["ent"])
    torch.testing.assert_close(loss, token_mean * d["mask"].sum() / 25)


def test_all_masked_batch_gives_zero_not_nan():
    d = make_data()
    d["mask"] = torch.zeros_like(d["mask"])
    for loss_type in LOSS_TYPES:
        logps = d["logps"].clone().requires_grad_(True)
        loss, _ = ours(loss_type, d, logps, d["ent"], beta=0.1)
        loss.backward()
        assert loss.item() == 0.0
        assert (logps.grad == 0).all()


def test_per_token_advantages_and_ppo_policy_loss():
    d = make_data()
    adv_tok = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    logps = d["logps"].clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(logps, d["old"], adv_tok, d["mask"], cliprange=0.2)
    expected = torch.zeros((), dtype=torch.float64)
    for i in range(8):
        for t in range(6):
            if d["mask"][i, t]:
                r = torch.exp(d["logps"][i, t] - d["old"][i, t])
                a = adv_tok[i, t]
                expected = expected + torch.maximum(-r * a, -torch.clamp(r, 0.8, 1.2) * a)
    torch.testing.assert_close(loss, expected / d["mask"].sum())


def test_ppo_value_loss_matches_reference():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(4, 5, dtype=torch.float64, generator=g).requires_grad_(True)
    old = values.detach() + torch.randn(4, 5, dtype=torch.float64, generator=g) * 0.5
    returns = torch.randn(4, 5, dtype=torch.float64, generator=g)
    mask = (torch.arange(5) < torch.tensor([[5], [2], [4], [1]])).to(torch.float64)
    loss, stats = ppo_value_loss(values, old, returns, mask, cliprange_value=0.2)
    loss.backward()

    v2 = values.detach().clone().requires_grad_(True)
    total, clipped, n = torch.zeros((), dtype=torch.float64), 0, 0
    for i in range(4):
        for t in range(5):
            if mask[i, t]:
                vc = old[i, t] + torch.clamp(v2[i, t] - old[i, t], -0.2, 0.2)
                a, b = (v2[i, t] - returns[i, t]) ** 2, (vc - returns[i, t]) ** 2
                total = total + 0.5 * torch.maximum(a, b)
                clipped += bool(b > a)
                n += 1
    ref = total / n
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(values.grad, v2.grad)
    assert stats["value_clipped"].item() == clipped and stats["token_count"].item() == n
    assert stats["clip_fraction"].item() == pytest.approx(clipped / n)


def test_settings_and_name_errors():
    with pytest.raises(ConfigError, match="delta"):
        PolicyLossSettings(epsilon=0.2, epsilon_high=0.28, delta=1.2)
    with pytest.raises(ConfigError, match="did you mean 'sequence'"):
        PolicyLossSettings(importance_sampling_level="sequense")
    with pytest.raises(ConfigError, match="beta"):
        PolicyLossSettings(beta=-1.0)
    with pytest.raises(
        ConfigError, match=r"unknown loss_type 'grpoo' \(did you mean 'grpo'\?\).*bnpo, cispo, dapo, dr_grpo, grpo, luspo, sapo, vespo"
    ):
        POLICY_LOSSES.get("grpoo")
    d = make_data()
    batch = PolicyLossBatch(logps=d["logps"], advantages=d["adv"], mask=d["mask"])
    with pytest.raises(DataError, match="ref_logps"):
        policy_loss("grpo", batch, PolicyLossSettings(beta=0.1))
    with pytest.raises(DataError, match="entropies"):
        policy_loss("grpo", batch, PolicyLossSettings(entropy_coef=0.1))
    with pytest.raises(ConfigError, match="max_completion_length"):
        policy_loss("dr_grpo", batch, PolicyLossSettings())
    bad = PolicyLossBatch(logps=d["logps"], advantages=d["adv"][:3], mask=d["mask"])
    with pytest.raises(DataError, match="advantages"):
        policy_loss("grpo", bad, PolicyLossSettings())
