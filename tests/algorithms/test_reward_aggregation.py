"""multi_objective_aggregation: sum_then_normalize is the advantage estimator on the weighted total;
normalize_then_sum is GDPO, against TRL 1.16's formula written with TRL's own ``nanstd``."""

from __future__ import annotations

import pytest
import torch

from grpo_ascend.algorithms.advantages import compute_advantages
from grpo_ascend.algorithms.reward_aggregation import (
    REWARD_AGGREGATIONS,
    GroupedRewards,
    aggregate_advantages,
)
from grpo_ascend.errors import ConfigError

G = 4


def rewards(seed: int = 0, groups: int = 5, functions: int = 3, none: bool = True) -> GroupedRewards:
    """Functions on very different scales; some None (NaN) entries and one completion no function scored."""
    g = torch.Generator().manual_seed(seed)
    per = torch.randn(groups * G, functions, generator=g) * torch.tensor([1.0, 50.0, 0.1])[:functions]
    if none:
        per[1, 0] = per[6, 2] = per[7, 2] = float("nan")
        per[9] = float("nan")
    weights = torch.tensor([1.0, 0.5, 2.0])[:functions]
    total = torch.nansum(per * weights, dim=1)
    return GroupedRewards(per, total, weights, G)


def trl_normalize_then_sum(r: GroupedRewards) -> torch.Tensor:
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, normalize_then_sum branch, then nan → 0."""
    nanstd = pytest.importorskip("trl.trainer.utils", reason="trl is not installed").nanstd
    per = r.per_function
    grouped = per.view(-1, G, per.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, per.shape[1])
    summed = (reward_k * r.weights.unsqueeze(0)).nansum(dim=1)
    summed[torch.isnan(per).all(dim=1)] = torch.nan
    adv = (summed - torch.nanmean(summed)) / (nanstd(summed).expand_as(summed) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_normalize_then_sum_matches_trl(seed):
    r = rewards(seed)
    out = aggregate_advantages("normalize_then_sum", r, "grpo", "group")
    torch.testing.assert_close(out.advantages, trl_normalize_then_sum(r), rtol=1e-5, atol=1e-5)
    assert out.advantages[9] == 0  # no function scored it
    assert out.advantages.shape == (20,) and not out.zero_variance.any()


def test_normalize_then_sum_is_blind_to_each_functions_scale():
    """GDPO's point: a function's scale (and shift) does not change its weight in the advantage."""
    r = rewards(3, none=False)
    scaled = r.per_function * torch.tensor([10.0, 0.01, 1.0]) + torch.tensor([5.0, -3.0, 0.0])
    base = aggregate_advantages("normalize_then_sum", r, "grpo", "none").advantages
    moved = aggregate_advantages("normalize_then_sum", GroupedRewards(scaled, r.total, r.weights, G), "grpo",
                                 "none").advantages
    torch.testing.assert_close(moved, base, rtol=1e-3, atol=1e-3)
    summed_first = aggregate_advantages("sum_then_normalize", r, "grpo", "group").advantages
    assert (summed_first - base).abs().max() > 0.1  # the default aggregation weighs the 50× function most


def test_normalize_then_sum_ignores_scale_rewards_and_zeroes_tied_groups():
    r = rewards(4, none=False)
    r.per_function[:G] = 1.0  # group 0: every function ties
    outs = [aggregate_advantages("normalize_then_sum", r, "grpo", s).advantages for s in ("group", "batch", "none")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    out = aggregate_advantages("normalize_then_sum", r, "grpo", "group")
    assert out.zero_variance.tolist() == [True, False, False, False, False]
    assert torch.allclose(out.advantages[:G], out.advantages[0].expand(G))  # one value: no signal within the group


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_sum_then_normalize_is_the_estimator_on_the_total(estimator, scale):
    r = rewards(5)
    out = aggregate_advantages("sum_then_normalize", r, estimator, scale)
    expected = compute_advantages(estimator, r.total, G, scale)
    assert torch.equal(out.advantages, expected.advantages)


def test_registry_names_and_errors():
    assert REWARD_AGGREGATIONS.names() == ["normalize_then_sum", "sum_then_normalize"]
    with pytest.raises(ConfigError, match="did you mean 'normalize_then_sum'"):
        aggregate_advantages("normalise_then_sum", rewards(), "grpo", "group")
