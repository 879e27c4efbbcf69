"""CISPO, SAPO, the KL estimators (k1/k2/k3, bias correction) and importance weights in the policy
loss, against per-token loop references written from the papers' formulas (TRL 1.16's meanings)."""

from __future__ import annotations

import math

import pytest
import torch
from reference_losses import (
    CISPO_CAP,
    EPS,
    EPS_HIGH,
    MAX_LEN,
    TAU_NEG,
    TAU_POS,
    kl_value,
    make_data,
    reference_loss,
)

from grpo_ascend.algorithms.kl import KL_ESTIMATORS, per_token_kl
from grpo_ascend.algorithms.losses import LossNormaliser, PolicyLossBatch, PolicyLossSettings, policy_loss
from grpo_ascend.errors import ConfigError, DataError

ALL_LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]


def ours(loss_type, d, logps, *, level="token", kl="k3", bias=False, beta=0.0, weights=None, delta=None,
         normaliser=None, rows=slice(None)):
    settings = PolicyLossSettings(
        epsilon=EPS,
        epsilon_high=CISPO_CAP if loss_type == "cispo" else EPS_HIGH,
        delta=delta,
        beta=beta,
        importance_sampling_level=level,
        max_completion_length=MAX_LEN,
        kl_estimator=kl,
        use_bias_correction_kl=bias,
        sapo_temperature_pos=TAU_POS,
        sapo_temperature_neg=TAU_NEG,
    )
    batch = PolicyLossBatch(
        logps=logps[rows], advantages=d["adv"][rows], mask=d["mask"][rows], old_logps=d["old"][rows],
        ref_logps=d["ref"][rows], weights=None if weights is None else weights[rows],
    )
    return policy_loss(loss_type, batch, settings, normaliser)


def token_weights(seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(8, 6, generator=g, dtype=torch.float64) * 2


CASES = [
    {},
    {"beta": 0.1, "kl": "k1"},
    {"beta": 0.1, "kl": "k2"},
    {"beta": 0.1, "kl": "k3"},
    {"beta": 0.1, "kl": "k1", "bias": True},
    {"beta": 0.1, "kl": "k2", "bias": True},
    {"beta": 0.1, "kl": "k3", "bias": True},
    {"weights": "token"},
    {"weights": "sequence", "beta": 0.05, "bias": True},
    {"level": "sequence"},
    {"level": "sequence", "beta": 0.05, "kl": "k3", "bias": True, "weights": "token"},
    {"level": "sequence", "beta": 0.05, "kl": "k2", "weights": "sequence"},
]


def _resolve(case):
    kw = dict(case)
    if kw.get("weights") == "token":
        kw["weights"] = token_weights()
    elif kw.get("weights") == "sequence":
        kw["weights"] = torch.tensor([1.0, 0.0, 2.5, 0.3, 1.0, 0.7, 0.0, 1.4], dtype=torch.float64)
    return kw


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("loss_type", ALL_LOSSES)
def test_value_and_gradient_match_reference(loss_type, case):
    d = make_data()
    kw = _resolve(case)
    lp1 = d["logps"].clone().requires_grad_(True)
    loss, _ = ours(loss_type, d, lp1, **kw)
    loss.backward()
    lp2 = d["logps"].clone().requires_grad_(True)
    ref = reference_loss(loss_type, d, lp2, **kw)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-10, atol=1e-12)
    assert (lp1.grad[d["mask"] == 0] == 0).all()


@pytest.mark.parametrize("loss_type", ALL_LOSSES)
def test_unit_weights_change_nothing(loss_type):
    d = make_data()
    kw = {"beta": 0.1, "bias": True}
    lp1 = d["logps"].clone().requires_grad_(True)
    plain, plain_stats = ours(loss_type, d, lp1, **kw)
    plain.backward()
    for ones in (torch.ones(8, 6, dtype=torch.float64), torch.ones(8, dtype=torch.float64)):
        lp2 = d["logps"].clone().requires_grad_(True)
        weighted, stats = ours(loss_type, d, lp2, weights=ones, **kw)
        weighted.backward()
        assert torch.equal(weighted, plain) and torch.equal(lp2.grad, lp1.grad)
        assert all(torch.equal(stats[k], plain_stats[k]) for k in stats)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_gradient_accumulation_is_exact(loss_type):
    d = make_data()
    kw = {"beta": 0.05, "bias": True, "weights": token_weights()}
    norm = LossNormaliser.for_step(d["mask"])
    lp_full = d["logps"].clone().requires_grad_(True)
    full, _ = ours(loss_type, d, lp_full, normaliser=norm, **kw)
    full.backward()
    lp_acc = d["logps"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, 8, 2):
        loss, _ = ours(loss_type, d, lp_acc, normaliser=norm, rows=slice(start, start + 2), **kw)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, full.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp_acc.grad, lp_full.grad, rtol=1e-10, atol=1e-12)


def test_sapo_gate_on_policy():
    """At r = 1 the gate is 4/τ·σ(0) = 2/τ and its slope is 1: the gradient is plain −A·∇logp."""
    logps = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    settings = PolicyLossSettings(sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    loss, stats = policy_loss("sapo", PolicyLossBatch(logps=logps, advantages=adv, mask=mask), settings)
    loss.backward()
    # grpo aggregation: mean over 2 sequences of token means of −(2/τ)·A.
    assert loss.item() == pytest.approx((-(2 / 0.5) * 1.0 - (2 / 2.0) * -2.0) / 2)
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.25, -0.25], [0.5, 0.5]], dtype=torch.float64))
    assert stats["clipped_region"].item() == 0


def test_cispo_clipped_stats_and_cap():
    d = make_data()
    _, stats = ours("cispo", d, d["logps"])
    r = torch.exp(d["logps"] - d["old"])
    expected = ((r > CISPO_CAP) & (d["adv"].unsqueeze(1) > 0) & d["mask"].bool()).sum().item()
    assert expected > 0
    assert stats["clipped_high"].item() == expected and stats["clipped_low"].item() == 0
    # No epsilon_high: the cap is epsilon (TRL's fallback), so every positive-advantage ratio above 0.2 is capped.
    _, fallback = policy_loss("cispo", PolicyLossBatch(logps=d["logps"], advantages=d["adv"], mask=d["mask"],
                                                       old_logps=d["old"]), PolicyLossSettings(epsilon=0.2))
    capped = ((r > 0.2) & (d["adv"].unsqueeze(1) > 0) & d["mask"].bool()).sum().item()
    assert fallback["clipped_high"].item() == capped > expected


def test_kl_estimators_on_numbers():
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    assert per_token_kl("k1", logp, ref).item() == pytest.approx(math.log(2))
    assert per_token_kl("k2", logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert per_token_kl("k3", logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(ConfigError, match=r"unknown kl_estimator 'k4'.*k1, k2, k3"):
        PolicyLossSettings(kl_estimator="k4")


def test_bias_correction_on_policy_adds_kl_times_score():
    """Ratio 1 in value, but d(k·r)/dlogp = dk/dlogp + k: the unbiased reverse-KL gradient."""
    d = make_data()
    m = d["mask"]
    grads = {}
    for bias in (False, True):
        lp = d["logps"].clone().requires_grad_(True)
        batch = PolicyLossBatch(logps=lp, advantages=torch.zeros(8, dtype=torch.float64), mask=m,
                                ref_logps=d["ref"])
        loss, stats = policy_loss("bnpo", batch, PolicyLossSettings(beta=1.0, use_bias_correction_kl=bias))
        loss.backward()
        grads[bias] = lp.grad
    k3 = torch.where(m.bool(), kl_value("k3", d["logps"], d["ref"]), torch.zeros_like(m))
    torch.testing.assert_close(grads[True] - grads[False], k3 / m.sum())


def test_weight_and_setting_errors():
    d = make_data()
    with pytest.raises(DataError, match="weights must be"):
        policy_loss("grpo", PolicyLossBatch(logps=d["logps"], advantages=d["adv"], mask=d["mask"],
                                            weights=torch.ones(3)), PolicyLossSettings())
    with pytest.raises(ConfigError, match="sapo_temperature_neg must be > 0"):
        PolicyLossSettings(sapo_temperature_neg=0.0)
