"""Group-relative advantage estimators (GRPO, RLOO) and DAPO's dynamic-sampling filter.

Layout: ``rewards`` is a 1-D tensor [N*G] of *total* (already weighted and summed) rewards,
grouped contiguously — the G completions of prompt i are rows i*G .. i*G+G-1. The total
arriving here must be finite: a reward function may return None/NaN for "not applicable" but
the reward module resolves those per function (nansum) before summing, so NaN never reaches
this module. In distributed training pass the rewards gathered from all ranks, so that group
statistics (and "batch" scaling) see whole groups.

Scaling (TRL's ``scale_rewards``): "group" divides by the std within each group, "batch" by the
std over the whole batch, "none" does not divide (Dr. GRPO). ``True`` means "group" and ``False``
means "none", as in TRL. The std is the unbiased one (Bessel-corrected, like TRL) and the
denominator is ``std + 1e-4`` so that nearly tied groups do not blow up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_ascend.algorithms.registry import Registry
from grpo_ascend.errors import ConfigError, DataError, closest

STD_EPS = 1e-4
SCALE_REWARDS_CHOICES = ("group", "batch", "none")


@dataclass
class AdvantageOutput:
    """Result of an advantage estimator.

    advantages: [N*G], same dtype/device as the rewards; exactly 0 in zero-variance groups.
    zero_variance: [N] bool, True where every reward of the group ties (no learning signal).
    group_mean / group_std: [N] per-group statistics (std unbiased), for logging.
    """

    advantages: Tensor
    zero_variance: Tensor
    group_mean: Tensor
    group_std: Tensor

    def metrics(self) -> dict[str, float]:
        """Summary statistics for metrics.jsonl (one host copy)."""
        adv = self.advantages.float()
        spread = adv.std() if adv.numel() > 1 else adv.new_zeros(())
        values = torch.stack([adv.mean(), spread, adv.abs().max(), self.zero_variance.float().mean(),
                              self.group_std.float().mean()]).tolist()
        return dict(zip(["advantages/mean", "advantages/std", "advantages/abs_max", "frac_reward_zero_std",
                         "reward_group_std/mean"], values))


AdvantageEstimator = Callable[..., AdvantageOutput]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def normalize_scale_rewards(scale_rewards: str | bool) -> str:
    """Map TRL's ``scale_rewards`` (a string or a bool) to one of "group", "batch", "none"."""
    if scale_rewards is True:
        return "group"
    if scale_rewards is False:
        return "none"
    if isinstance(scale_rewards, str) and scale_rewards in SCALE_REWARDS_CHOICES:
        return scale_rewards
    hint = closest(scale_rewards, SCALE_REWARDS_CHOICES) if isinstance(scale_rewards, str) else ""
    raise ConfigError(
        f"scale_rewards={scale_rewards!r} is not valid{hint}; use one of "
        f"{', '.join(SCALE_REWARDS_CHOICES)} (or True = 'group', False = 'none')"
    )


def _grouped(rewards: Tensor, num_generations: int) -> Tensor:
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise ConfigError(f"num_generations must be a positive int, got {num_generations!r}")
    if rewards.dim() != 1:
        raise DataError(f"rewards must be 1-D [N*G], got shape {tuple(rewards.shape)}")
    if rewards.numel() % num_generations != 0:
        raise DataError(
            f"{rewards.numel()} rewards cannot be split into groups of num_generations={num_generations}"
        )
    return rewards.view(-1, num_generations)


def _zero_variance(groups: Tensor) -> Tensor:
    # Exact tie test (max == min) rather than std < eps: a tiny but real spread is still signal.
    return groups.amax(dim=1) == groups.amin(dim=1)


def _unbiased_std(x: Tensor, dim: int | None = None) -> Tensor:
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        # A single sample has no spread; 0 keeps the division finite (denominator is 0 + eps).
        return torch.zeros_like(x.sum(dim=dim) if dim is not None else x.sum())
    return x.std(dim=dim, unbiased=True) if dim is not None else x.std(unbiased=True)


def _scale(centered: Tensor, groups: Tensor, group_std: Tensor, scale: str) -> Tensor:
    if scale == "group":
        return centered / (group_std.unsqueeze(1) + STD_EPS)
    if scale == "batch":
        return centered / (_unbiased_std(groups.reshape(-1)) + STD_EPS)
    return centered


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: str | bool = "group"
) -> AdvantageOutput:
    """GRPO group-relative advantages: (reward − group mean) / (std + 1e-4), std per ``scale_rewards``."""
    scale = normalize_scale_rewards(scale_rewards)
    groups = _grouped(rewards, num_generations)
    mean = groups.mean(dim=1)
    std = _unbiased_std(groups, dim=1)
    zero_var = _zero_variance(groups)
    adv = _scale(groups - mean.unsqueeze(1), groups, std, scale)
    # The float mean of tied values can differ from them in the last bit; force an exact 0.
    adv = torch.where(zero_var.unsqueeze(1), torch.zeros_like(adv), adv)
    return AdvantageOutput(adv.reshape(-1), zero_var, mean, std)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: str | bool = "none"
) -> AdvantageOutput:
    """RLOO: reward − mean of the *other* G−1 rewards of the group (= G/(G−1)·(r − mean)).

    Scaling follows the same ``scale_rewards`` rule as GRPO (default "none", as in RLOO).
    """
    scale = normalize_scale_rewards(scale_rewards)
    groups = _grouped(rewards, num_generations)
    if num_generations < 2:
        raise ConfigError("rloo needs num_generations >= 2 (the baseline is the other completions' mean)")
    mean = groups.mean(dim=1)
    std = _unbiased_std(groups, dim=1)
    zero_var = _zero_variance(groups)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (num_generations - 1)
    adv = _scale(groups - baseline, groups, std, scale)
    adv = torch.where(zero_var.unsqueeze(1), torch.zeros_like(adv), adv)
    return AdvantageOutput(adv.reshape(-1), zero_var, mean, std)


def compute_advantages(
    name: str, rewards: Tensor, num_generations: int, scale_rewards: str | bool = "group"
) -> AdvantageOutput:
    """Run the estimator registered as ``name`` (ConfigError naming the valid ones if unknown)."""
    return ADVANTAGE_ESTIMATORS.get(name)(rewards, num_generations, scale_rewards)


def select_informative_groups(rewards: Tensor, num_generations: int) -> Tensor:
    """DAPO dynamic sampling: bool mask [N] of groups whose rewards do not all tie.

    Groups whose completions all got the same reward have zero advantage and give no gradient;
    DAPO drops them and samples more prompts until the batch is full of informative groups.
    """
    return ~_zero_variance(_grouped(rewards, num_generations))
