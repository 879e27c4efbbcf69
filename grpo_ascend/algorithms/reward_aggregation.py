"""How several reward functions become one advantage per completion (TRL's ``multi_objective_aggregation``).

* ``sum_then_normalize`` (the default): the weighted sum of the functions' rewards (None left out) goes
  through the advantage estimator, scaled per ``scale_rewards``.
* ``normalize_then_sum`` (GDPO, arXiv 2601.05242): each function's rewards are normalised within their
  group, (r − group mean) / (group std + 1e-4), the results weighted and summed, and that sum normalised
  over the whole batch, (s − batch mean) / (batch std + 1e-4). So a function with a large scale cannot
  drown the others' within-group signal. ``scale_rewards`` plays no part (as in TRL).

Statistics ignore NaN (a function that returned None); a completion no function scored gets
advantage 0, and stays out of the batch statistics. Stds are unbiased, as everywhere here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_ascend.algorithms.advantages import STD_EPS, AdvantageOutput, compute_advantages
from grpo_ascend.algorithms.registry import Registry
from grpo_ascend.errors import DataError


@dataclass
class GroupedRewards:
    """Rewards of whole groups (rows i*G .. i*G+G-1 share prompt i), gathered over all ranks.

    per_function: [N*G, F], NaN where a function returned None. total: [N*G] their weighted sum
    ignoring NaN. weights: [F] the reward weights.
    """

    per_function: Tensor
    total: Tensor
    weights: Tensor
    num_generations: int


Aggregation = Callable[[GroupedRewards, str, "str | bool"], AdvantageOutput]
REWARD_AGGREGATIONS: Registry[Aggregation] = Registry("multi_objective_aggregation")


@REWARD_AGGREGATIONS.register("sum_then_normalize")
def sum_then_normalize(rewards: GroupedRewards, estimator: str, scale_rewards: str | bool) -> AdvantageOutput:
    """The advantage estimator on the weighted total (each function's weight applied before any scaling)."""
    return compute_advantages(estimator, rewards.total, rewards.num_generations, scale_rewards)


def _nan_mean_std(x: Tensor, dim: int | None) -> tuple[Tensor, Tensor]:
    """Mean and unbiased std ignoring NaN (NaN where fewer than 1 / 2 values)."""
    valid = ~torch.isnan(x)
    count = valid.sum(dim) if dim is not None else valid.sum()
    filled = torch.where(valid, x, torch.zeros_like(x))
    total = filled.sum(dim) if dim is not None else filled.sum()
    mean = total / count
    centred = torch.where(valid, x - (mean.unsqueeze(dim) if dim is not None else mean), torch.zeros_like(x))
    squares = (centred**2).sum(dim) if dim is not None else (centred**2).sum()
    return mean, (squares / (count - 1)).sqrt()


@REWARD_AGGREGATIONS.register("normalize_then_sum")
def normalize_then_sum(rewards: GroupedRewards, estimator: str, scale_rewards: str | bool) -> AdvantageOutput:
    """GDPO: per-function group normalisation, weighted sum, batch normalisation (see the module docstring)."""
    G = rewards.num_generations
    per = rewards.per_function.float()
    if per.dim() != 2 or per.shape[0] % G or per.shape[1] != rewards.weights.numel():
        raise DataError(f"per-function rewards of shape {tuple(per.shape)} do not make groups of {G} rows with "
                        f"{rewards.weights.numel()} reward functions")
    groups = per.view(-1, G, per.shape[1])
    mean, std = _nan_mean_std(groups, dim=1)
    std = std if G > 1 else torch.zeros_like(std)
    normalised = ((groups - mean.unsqueeze(1)) / (std.unsqueeze(1) + STD_EPS)).view_as(per)
    summed = torch.nansum(normalised * rewards.weights.to(per).unsqueeze(0), dim=1)
    unscored = torch.isnan(per).all(dim=1)
    summed = torch.where(unscored, torch.full_like(summed, float("nan")), summed)
    batch_mean, batch_std = _nan_mean_std(summed, dim=None)
    batch_std = batch_std if summed.numel() > 1 else torch.zeros_like(batch_std)
    advantages = torch.nan_to_num((summed - batch_mean) / (batch_std + STD_EPS), nan=0.0)
    summed_groups = torch.where(unscored, torch.zeros_like(summed), summed).view(-1, G)
    zero_variance = summed_groups.amax(dim=1) == summed_groups.amin(dim=1)
    totals = rewards.total.float().view(-1, G)
    return AdvantageOutput(advantages.to(rewards.total.dtype), zero_variance, totals.mean(dim=1),
                           totals.std(dim=1) if G > 1 else torch.zeros(totals.shape[0]))


def aggregate_advantages(name: str, rewards: GroupedRewards, estimator: str, scale_rewards: str | bool) -> AdvantageOutput:
    """Advantages by the aggregation registered as ``name`` (ConfigError naming the valid ones if unknown)."""
    return REWARD_AGGREGATIONS.get(name)(rewards, estimator, scale_rewards)
