"""LUSPO, VESPO, the off-policy sequence mask, the high-entropy token mask, CISPO's cap fallback and
TRL's GSPO spelling, against TRL 1.16's own code on random inputs: ``GRPOTrainer._compute_loss`` run
on a minimal stand-in trainer (as bench/check_losses_vs_trl.py does), and TRL's standalone
``get_off_policy_mask`` / ``get_gamma_weights`` / ``get_high_entropy_mask``. float64, one process."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from grpo_ascend.algorithms.losses import (
    PolicyLossBatch,
    PolicyLossSettings,
    policy_loss,
    vespo_gamma_weights,
)
from grpo_ascend.algorithms.token_selection import high_entropy_mask, off_policy_sequence_mask
from grpo_ascend.errors import ConfigError

B, T, MAX_LEN = 8, 7, 12
EPS, EPS_HIGH = 0.2, 0.28


def _trainer_class():
    return pytest.importorskip("trl.trainer.grpo_trainer", reason="trl is not installed").GRPOTrainer


def random_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Ratios on both sides of the clipping edges, padding, sampler log-probs some way off the old ones."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = logps - torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    sampling = old + torch.randn(B, T, generator=g, dtype=torch.float64).abs() * torch.linspace(0, 1.5, B)[:, None]
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lengths = torch.tensor([7, 3, 1, 5, 7, 6, 2, 4])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[:4] = adv[:4].abs()
    adv[4:] = -adv[4:].abs()  # both signs by construction
    return {"logps": logps, "old": old, "ref": ref, "sampling": sampling, "ent": entropies, "mask": mask, "adv": adv}


def trl_loss(d, loss_type, *, level="token", beta=0.0, eps_high=EPS_HIGH, off_policy=None, quantile=1.0,
             is_ratio=None, vespo=(2.0, 3.0, 3.0, 2.0)):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on a stand-in ``self``; returns (loss, d loss / d logps)."""
    trainer = _trainer_class()
    logps = d["logps"].clone().requires_grad_(True)
    accelerator = types.SimpleNamespace(
        num_processes=1, gather=lambda x: x, reduce=lambda x, reduction="sum": x,
        pad_across_processes=lambda x, dim=0, pad_index=0: x,
    )
    stub = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, d["ent"], None),
        aux_loss_enabled=False, top_entropy_quantile=quantile, off_policy_mask_threshold=off_policy,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=EPS, epsilon_high=eps_high,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN, accelerator=accelerator, _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)}, get_off_policy_mask=trainer.get_off_policy_mask,
        get_gamma_weights=trainer.get_gamma_weights,
        args=types.SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=1,
                                   sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=vespo[0],
                                   vespo_lambda_pos=vespo[1], vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3]),
    )
    stub.get_high_entropy_mask = lambda e, m, t: trainer.get_high_entropy_mask(stub, e, m, t)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": d["mask"],
        "advantages": d["adv"], "old_per_token_logps": d["old"], "ref_per_token_logps": d["ref"],
        "sampling_per_token_logps": d["sampling"], "num_items_in_batch": d["mask"].sum(),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = trainer._compute_loss(stub, None, inputs)
    loss.backward()
    return loss.detach(), logps.grad


def our_loss(d, loss_type, *, level="token", beta=0.0, eps_high=EPS_HIGH, off_policy=None, quantile=1.0,
             weights=None):
    logps = d["logps"].clone().requires_grad_(True)
    settings = PolicyLossSettings(epsilon=EPS, epsilon_high=eps_high, beta=beta, importance_sampling_level=level,
                                  max_completion_length=MAX_LEN, use_bias_correction_kl=True,
                                  off_policy_mask_threshold=off_policy)
    selection = None if quantile == 1.0 else high_entropy_mask(d["ent"], d["mask"], quantile)
    batch = PolicyLossBatch(logps=logps, advantages=d["adv"], mask=d["mask"], old_logps=d["old"], ref_logps=d["ref"],
                            sampling_logps=d["sampling"], selection=selection, weights=weights)
    loss, _ = policy_loss(loss_type, batch, settings)
    loss.backward()
    return loss.detach(), logps.grad


def _close(trl, ours):
    torch.testing.assert_close(ours[0], trl[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(ours[1], trl[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["luspo", "vespo"])
def test_new_loss_types_match_trl(loss_type, beta, level):
    d = random_inputs()
    _close(trl_loss(d, loss_type, level=level, beta=beta), our_loss(d, loss_type, level=level, beta=beta))


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_folds_importance_weights_into_its_gamma_weight(mode):
    """TRL multiplies no IS ratio into VESPO's loss: log c enters log w. Bounds hold 1, so padded c = 1 in TRL too."""
    d = random_inputs(1)
    ratio = torch.exp((d["old"] - d["sampling"]) * d["mask"])
    ratio = ratio.clamp(0.5, 1.3) if mode == "token_truncate" else ratio.masked_fill((ratio < 0.5) | (ratio > 1.3), 0)
    assert (ratio[d["mask"].bool()] == 0).any() or mode == "token_truncate"
    _close(trl_loss(d, "vespo", is_ratio=ratio), our_loss(d, "vespo", weights=ratio))


def test_vespo_gamma_weight_is_trls_function_and_one_on_policy():
    trainer = _trainer_class()
    d = random_inputs(2)
    batch = PolicyLossBatch(logps=d["logps"], advantages=d["adv"], mask=d["mask"], old_logps=d["old"])
    ours = vespo_gamma_weights(batch, PolicyLossSettings(vespo_k_pos=1.5, vespo_lambda_pos=2.5))
    theirs = trainer.get_gamma_weights(d["adv"].unsqueeze(1), d["logps"] - d["old"], d["mask"], None,
                                       k_pos=1.5, lambda_pos=2.5, k_neg=3.0, lambda_neg=2.0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    on_policy = vespo_gamma_weights(PolicyLossBatch(logps=d["logps"], advantages=d["adv"], mask=d["mask"]),
                                    PolicyLossSettings())
    torch.testing.assert_close(on_policy, torch.ones(B, 1, dtype=torch.float64), rtol=0, atol=1e-15)


def test_vespo_refuses_sequence_importance_weights():
    d = random_inputs()
    with pytest.raises(ConfigError, match="token_truncate"):
        our_loss(d, "vespo", weights=torch.ones(B, dtype=torch.float64))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_off_policy_mask_matches_trl(loss_type):
    d = random_inputs(3)
    ours_mask = off_policy_sequence_mask(d["adv"], d["logps"], d["sampling"], d["mask"], 0.3)
    theirs_mask = _trainer_class().get_off_policy_mask(d["adv"].unsqueeze(1), d["logps"], d["sampling"], d["mask"], 0.3)
    torch.testing.assert_close(ours_mask, theirs_mask, rtol=0, atol=0)
    kept = ours_mask.squeeze(1)
    assert 0 < kept.sum() < B  # some negative-advantage sequences dropped, by construction
    assert bool((kept[d["adv"] >= 0] == 1).all())
    eps_high = 1.5 if loss_type == "cispo" else EPS_HIGH
    _close(trl_loss(d, loss_type, off_policy=0.3, beta=0.04, eps_high=eps_high),
           our_loss(d, loss_type, off_policy=0.3, beta=0.04, eps_high=eps_high))


def test_off_policy_mask_drops_by_the_formula():
    """Sequence i is dropped exactly when A_i < 0 and mean_t (sampling − logp) > δ."""
    d = random_inputs(4)
    mean_kl = ((d["sampling"] - d["logps"]) * d["mask"]).sum(-1) / d["mask"].sum(-1)
    for delta in (0.0, 0.2, 0.5):
        got = off_policy_sequence_mask(d["adv"], d["logps"], d["sampling"], d["mask"], delta).squeeze(1)
        expected = ~((d["adv"] < 0) & (mean_kl > delta))
        assert got.bool().tolist() == expected.tolist()


@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "luspo"])
def test_top_entropy_quantile_matches_trl(loss_type, quantile):
    d = random_inputs(5)
    _close(trl_loss(d, loss_type, quantile=quantile, beta=0.04), our_loss(d, loss_type, quantile=quantile, beta=0.04))


def test_high_entropy_mask_keeps_the_top_fraction():
    d = random_inputs(6)
    theirs = _trainer_class().get_high_entropy_mask(
        types.SimpleNamespace(accelerator=types.SimpleNamespace(pad_across_processes=lambda x, **k: x,
                                                                gather=lambda x: x)), d["ent"], d["mask"], 0.8)
    ours = high_entropy_mask(d["ent"], d["mask"], 0.2)
    assert torch.equal(ours, theirs)
    valid = d["ent"][d["mask"].bool()]
    assert ours.sum() == (valid >= torch.quantile(valid.float(), 0.8)).sum()
    assert not (ours & ~d["mask"].bool()).any()
    top = high_entropy_mask(d["ent"], d["mask"], 0.0)
    assert top.sum() == 1 and d["ent"][top] == valid.max()
    assert torch.equal(high_entropy_mask(d["ent"], d["mask"], 1.0), d["mask"].bool())
    # Another rank's entropies move the threshold: gathered values count, the negative padding does not.
    pooled = high_entropy_mask(d["ent"], d["mask"], 0.5,
                               gather=lambda x: torch.cat([x, torch.full((3,), 100.0), torch.full((2,), -1e9)]))
    assert pooled.sum() < high_entropy_mask(d["ent"], d["mask"], 0.5).sum()
    with pytest.raises(ConfigError, match="top_entropy_quantile"):
        high_entropy_mask(d["ent"], d["mask"], 1.5)


def test_selection_limits_the_entropy_bonus_to_the_selected_tokens():
    d = random_inputs(7)
    ent = d["ent"].clone().requires_grad_(True)
    selection = high_entropy_mask(d["ent"], d["mask"], 0.3)
    settings = PolicyLossSettings(entropy_coef=0.1)
    batch = PolicyLossBatch(logps=d["logps"], advantages=torch.zeros(B, dtype=torch.float64), mask=d["mask"],
                            entropies=ent, selection=selection)
    loss, _ = policy_loss("bnpo", batch, settings)
    loss.backward()
    expected = -0.1 * selection.to(torch.float64) / d["mask"].sum()
    torch.testing.assert_close(ent.grad, expected, rtol=0, atol=1e-15)


def test_cispo_without_epsilon_high_caps_at_epsilon_like_trl():
    d = random_inputs(8)
    _close(trl_loss(d, "cispo", eps_high=EPS), our_loss(d, "cispo", eps_high=None))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_trl_gspo_spelling_matches_trl(loss_type):
    """TRL's GSPO: importance_sampling_level='sequence' with any clipped loss type."""
    d = random_inputs(9)
    _close(trl_loss(d, loss_type, level="sequence", beta=0.04), our_loss(d, loss_type, level="sequence", beta=0.04))
