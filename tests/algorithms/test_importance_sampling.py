"""Importance-sampling correction of the sampler/trainer mismatch: weights per mode and metrics, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_ascend.algorithms.importance_sampling import (
    ImportanceSamplingSettings,
    importance_sampling_metrics,
    importance_sampling_weights,
    reduce_stats,
)
from grpo_ascend.algorithms.losses import PolicyLossBatch, PolicyLossSettings, policy_loss
from grpo_ascend.errors import ConfigError, DataError

# trainer − sampler log-prob differences; row 1 has a padded last token, row 2 is all padding.
DIFF = torch.tensor([[0.1, -0.2, 1.5], [-1.0, -0.6, 9.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float64)
TRAINER = torch.full((3, 3), -1.0, dtype=torch.float64)
SAMPLER = TRAINER - DIFF


def weights(mode: str, clip_max: float | None = 2.0, clip_min: float | None = 0.5):
    settings = ImportanceSamplingSettings(mode=mode, clip_max=clip_max, clip_min=clip_min)
    return importance_sampling_weights(SAMPLER, TRAINER, MASK, settings)


def test_token_truncate():
    out = weights("token_truncate")
    e = math.exp
    expected = [[e(0.1), e(-0.2), 2.0], [0.5, e(-0.6), 1.0], [1.0, 1.0, 1.0]]
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64))
    assert out.stats["clipped_count"].item() == 2 and out.stats["unit_count"].item() == 5


def test_token_mask():
    out = weights("token_mask")
    e = math.exp
    expected = [[e(0.1), e(-0.2), 0.0], [0.0, e(-0.6), 1.0], [1.0, 1.0, 1.0]]
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64))


def test_sequence_truncate_and_mask():
    # Sequence log-ratios: row 0: 0.1 − 0.2 + 1.5 = 1.4 (ratio 4.06 > 2); row 1: −1.6 (0.20 < 0.5).
    trunc = weights("sequence_truncate")
    torch.testing.assert_close(trunc.weights[:2], torch.tensor([[2.0] * 3, [0.5] * 3], dtype=torch.float64))
    masked = weights("sequence_mask", clip_min=None, clip_max=5.0)
    torch.testing.assert_close(masked.weights[0], torch.full((3,), math.exp(1.4), dtype=torch.float64))
    torch.testing.assert_close(masked.weights[1], torch.full((3,), math.exp(-1.6), dtype=torch.float64))
    assert masked.stats["unit_count"].item() == 2 and masked.stats["clipped_count"].item() == 0
    dropped = weights("sequence_mask", clip_min=0.5, clip_max=3.0)
    assert dropped.weights[:2].abs().sum().item() == 0
    assert dropped.stats["clipped_count"].item() == 2


def test_metrics_are_exact():
    out = weights("token_truncate")
    m = importance_sampling_metrics(out.stats)
    valid = [0.1, -0.2, 1.5, -1.0, -0.6]
    kl = sum(math.exp(x) - 1 - x for x in valid) / 5
    assert m["sampling/kl"] == pytest.approx(kl)
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(abs(x) for x in valid) / 5)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(1.5)
    w = [math.exp(0.1), math.exp(-0.2), 2.0, 0.5, math.exp(-0.6)]
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(w) / 5)
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.5)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(2.0)
    assert m["sampling/importance_sampling_clipped_fraction"] == pytest.approx(2 / 5)


def test_stats_reduce_over_ranks_like_one_process():
    """Two 'ranks' holding rows 0 and 1 give the metrics of one process holding both."""
    settings = ImportanceSamplingSettings("token_truncate", 2.0, 0.5)
    parts = [importance_sampling_weights(SAMPLER[i : i + 1], TRAINER[i : i + 1], MASK[i : i + 1], settings).stats
             for i in (0, 1)]

    def two_ranks(values, op):  # what Ranks.sum_scalars does across processes
        combine = sum if op == "sum" else max
        return {k: float(combine(float(p[k] if k in p else 0) for p in rank_values(values))) for k in values}

    def rank_values(values):
        signs = {k: (-1.0 if k.endswith("_min") else 1.0) if k.endswith(("_max", "_min")) else 1.0 for k in values}
        return [{k: part[k] * signs[k] for k in values} for part in parts]

    whole = importance_sampling_weights(SAMPLER[:2], TRAINER[:2], MASK[:2], settings).stats
    reduced = reduce_stats(parts[0], two_ranks)
    assert reduced.keys() == whole.keys()
    for key in whole:
        assert reduced[key] == pytest.approx(float(whole[key])), key


def test_unscored_tokens_count_as_ratio_one():
    sampler = SAMPLER.clone()
    sampler[0, 2] = float("nan")
    out = importance_sampling_weights(sampler, TRAINER, MASK, ImportanceSamplingSettings("token_truncate"))
    assert out.weights[0, 2].item() == 1.0
    seq = importance_sampling_weights(sampler, TRAINER, MASK, ImportanceSamplingSettings("sequence_truncate"))
    assert seq.weights[0, 0].item() == pytest.approx(math.exp(-0.1))
    assert all(math.isfinite(v) for v in importance_sampling_metrics(out.stats).values())


def test_weights_enter_the_loss_as_multipliers():
    """Masked sequences contribute nothing; truncated weights scale each token's policy term."""
    logps = TRAINER.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    dropped = weights("sequence_mask", clip_min=0.5, clip_max=3.0)
    batch = PolicyLossBatch(logps=logps, advantages=adv, mask=MASK, weights=dropped.weights)
    loss, _ = policy_loss("bnpo", batch, PolicyLossSettings())
    loss.backward()
    assert loss.item() == 0.0 and (logps.grad == 0).all()
    logps.grad = None
    trunc = weights("token_truncate")
    batch = PolicyLossBatch(logps=logps, advantages=adv, mask=MASK, weights=trunc.weights)
    loss, _ = policy_loss("bnpo", batch, PolicyLossSettings())
    loss.backward()
    expected = -(trunc.weights * adv.unsqueeze(1) * MASK).sum() / MASK.sum()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logps.grad, -(trunc.weights * adv.unsqueeze(1) * MASK) / MASK.sum())


def test_setting_errors():
    with pytest.raises(ConfigError, match=r"'token_trunc' is not valid \(did you mean 'token_truncate'\?\)"):
        ImportanceSamplingSettings(mode="token_trunc")
    with pytest.raises(ConfigError, match="clip_min .* must be less than"):
        ImportanceSamplingSettings(clip_min=3.0, clip_max=2.0)
    with pytest.raises(ConfigError, match="needs importance_sampling_clip_max or importance_sampling_clip_min"):
        ImportanceSamplingSettings(mode="token_truncate", clip_max=None)
    with pytest.raises(ConfigError, match="clip_max=-1.0"):
        ImportanceSamplingSettings(clip_max=-1.0)
    with pytest.raises(DataError, match="same"):
        importance_sampling_weights(SAMPLER[:2], TRAINER, MASK, ImportanceSamplingSettings())
