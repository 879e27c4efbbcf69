"""Group-relative advantages, scale_rewards modes, zero-variance groups, DAPO filter, registry."""

from __future__ import annotations

import statistics

import pytest
import torch

from grpo_ascend.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    grpo_advantages,
    normalize_scale_rewards,
    rloo_advantages,
    select_informative_groups,
)
from grpo_ascend.algorithms.registry import Registry
from grpo_ascend.errors import ConfigError, DataError

REWARDS = [1.0, 0.0, 0.5, 0.5, 0.3, 0.3, 0.3, 0.3, -2.0, 4.0, 1.0, 0.0]  # 3 groups of 4, middle tied
G = 4


def reference(rewards: list[float], g: int, scale: str) -> list[float]:
    groups = [rewards[i : i + g] for i in range(0, len(rewards), g)]
    batch_std = statistics.stdev(rewards)
    out = []
    for grp in groups:
        mean = sum(grp) / g
        std = statistics.stdev(grp)
        denom = {"group": std + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
        out += [(r - mean) / denom for r in grp]
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none", True, False])
def test_grpo_matches_reference(scale):
    r = torch.tensor(REWARDS, dtype=torch.float64)
    out = grpo_advantages(r, G, scale)
    expected = reference(REWARDS, G, normalize_scale_rewards(scale))
    torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=torch.float64))
    assert out.zero_variance.tolist() == [False, True, False]
    assert (out.advantages[4:8] == 0).all()
    torch.testing.assert_close(out.group_mean, torch.tensor([0.5, 0.3, 0.75], dtype=torch.float64))


def test_tied_group_is_exactly_zero_in_float32():
    # 0.1 summed and averaged in float32 is not exactly 0.1; the tie must still give exact zeros.
    r = torch.full((8,), 0.1, dtype=torch.float32)
    out = grpo_advantages(r, 8, "none")
    assert (out.advantages == 0).all()
    assert out.zero_variance.tolist() == [True]


def test_rloo_is_leave_one_out():
    r = torch.tensor(REWARDS, dtype=torch.float64)
    out = rloo_advantages(r, G)
    for i, x in enumerate(REWARDS):
        grp = REWARDS[(i // G) * G : (i // G) * G + G]
        others = (sum(grp) - x) / (G - 1)
        assert out.advantages[i].item() == pytest.approx(x - others)


def test_registry_and_errors():
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"grpo", "rloo"}
    r = torch.tensor(REWARDS)
    torch.testing.assert_close(compute_advantages("grpo", r, G).advantages, grpo_advantages(r, G).advantages)
    with pytest.raises(ConfigError, match=r"'grpp' \(did you mean 'grpo'\?\); valid values: grpo, rloo"):
        compute_advantages("grpp", r, G)
    with pytest.raises(ConfigError, match="scale_rewards='grop'.*did you mean 'group'"):
        grpo_advantages(r, G, "grop")
    with pytest.raises(DataError, match="groups of num_generations=5"):
        grpo_advantages(r, 5)
    with pytest.raises(DataError, match="1-D"):
        grpo_advantages(r.view(3, 4), G)
    with pytest.raises(ConfigError, match="num_generations"):
        grpo_advantages(r, 0)


def test_single_generation_gives_zero_advantages():
    out = grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), 1)
    assert (out.advantages == 0).all() and out.zero_variance.all()


def test_select_informative_groups():
    r = torch.tensor(REWARDS)
    assert select_informative_groups(r, G).tolist() == [True, False, True]
    assert select_informative_groups(torch.zeros(6), 3).tolist() == [False, False]


def test_generic_registry():
    reg: Registry[int] = Registry("widget")
    reg.register("alpha")(1)
    assert reg.get("alpha") == 1 and "alpha" in reg and len(reg) == 1 and list(reg) == ["alpha"]
    with pytest.raises(ValueError, match="already registered"):
        reg.register("alpha")(2)
    with pytest.raises(ConfigError, match=r"unknown widget 'alpa' \(did you mean 'alpha'\?\)"):
        reg.get("alpa")
    with pytest.raises(ConfigError, match="unknown widget"):
        reg.get(["not", "hashable"])  # type: ignore[arg-type]
