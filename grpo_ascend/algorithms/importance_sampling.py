"""Importance-sampling correction of the sampler/trainer mismatch (TRL's ``vllm_importance_sampling_*``).

When completions come from a sampler whose log-probs differ from the trainer's (bf16 sampling, an
external engine such as vLLM, a rollout with merged LoRA), the policy gradient is taken under the
wrong distribution. Each token (or sequence) is re-weighted by ρ = π_trainer / π_sampler, computed
from the trainer's old log-probs and the sampler's log-probs, and kept bounded:

* ``token_truncate``:    ρ_t = clamp(exp(old_t − sampler_t), C_min, C_max)
* ``token_mask``:        ρ_t = exp(old_t − sampler_t), set to 0 where outside [C_min, C_max]
* ``sequence_truncate``: ρ_i = clamp(exp(Σ_t (old_t − sampler_t)), C_min, C_max) for every token of i
* ``sequence_mask``:     the same sequence ratio, set to 0 (the sequence dropped) outside [C_min, C_max]

(C_min = None: no lower bound, C_max = None: no upper bound.) Tokens whose sampler log-prob is NaN
(not scored) count as ratio 1. The weights go to ``PolicyLossBatch.weights`` and multiply each
token's policy-gradient term.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_ascend.errors import ConfigError, DataError, closest

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class ImportanceSamplingSettings:
    """``mode`` one of IMPORTANCE_SAMPLING_MODES; ``clip_max``/``clip_min`` the bounds C_max/C_min (None = none)."""

    mode: str = "sequence_mask"
    clip_max: float | None = 3.0
    clip_min: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in IMPORTANCE_SAMPLING_MODES:
            raise ConfigError(
                f"importance_sampling_mode={self.mode!r} is not valid{closest(str(self.mode), IMPORTANCE_SAMPLING_MODES)}; "
                f"use one of {', '.join(IMPORTANCE_SAMPLING_MODES)}"
            )
        for name in ("clip_max", "clip_min"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"importance_sampling_{name}={value!r} must be a finite number >= 0 or null")
        if self.clip_min is not None and self.clip_max is not None and self.clip_min >= self.clip_max:
            raise ConfigError(
                f"importance_sampling_clip_min ({self.clip_min}) must be less than "
                f"importance_sampling_clip_max ({self.clip_max})"
            )
        if self.mode.endswith("_truncate") and self.clip_min is None and self.clip_max is None:
            raise ConfigError(
                f"importance_sampling_mode={self.mode!r} truncates the ratio, so it needs "
                "importance_sampling_clip_max or importance_sampling_clip_min"
            )

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")


@dataclass
class ImportanceWeights:
    """Per-token weights ``[B, T]`` (no grad) and detached stat tensors for the mismatch metrics.

    ``stats`` are reducible over micro-batches and ranks: keys ending in ``_sum``/``_count`` add,
    ``_max`` takes the maximum and ``_min`` the minimum (``reduce_stats``); ``importance_sampling_metrics``
    turns them into metrics.
    """

    weights: Tensor
    stats: dict[str, Tensor]


def importance_sampling_weights(
    sampling_logps: Tensor, trainer_logps: Tensor, mask: Tensor, settings: ImportanceSamplingSettings
) -> ImportanceWeights:
    """Weights correcting samples of the sampler (``sampling_logps``) towards the trainer (``trainer_logps``).

    All inputs ``[B, T]``; ``mask`` marks the completion tokens in the loss (tool responses out).
    Stats: token_count, kl_sum (k3 estimate of KL(sampler ‖ trainer) per token, from the sampler's
    samples: ρ − 1 − log ρ), logp_diff_abs_sum / logp_diff_abs_max (|trainer − sampler|), and over the
    units weighted (tokens, or sequences with a valid token): unit_count, clipped_count (ratio outside
    [C_min, C_max]: truncated or masked), weight_sum, weight_min, weight_max (after truncation/masking).
    """
    if sampling_logps.shape != trainer_logps.shape or mask.shape != trainer_logps.shape:
        raise DataError(
            f"sampling_logps {tuple(sampling_logps.shape)}, trainer_logps {tuple(trainer_logps.shape)} and "
            f"mask {tuple(mask.shape)} must have the same [B, T] shape"
        )
    with torch.no_grad():
        valid = mask.bool()
        scored = valid & ~torch.isnan(sampling_logps)
        zero = torch.zeros((), dtype=trainer_logps.dtype, device=trainer_logps.device)
        diff = torch.where(scored, trainer_logps - sampling_logps, zero)
        if settings.sequence_level:
            log_ratio = diff.sum(-1, keepdim=True)
            units = valid.any(-1, keepdim=True)
        else:
            log_ratio = diff
            units = valid
        ratio = torch.exp(log_ratio)
        low = -math.inf if settings.clip_min is None else settings.clip_min
        high = math.inf if settings.clip_max is None else settings.clip_max
        outside = (ratio < low) | (ratio > high)
        if settings.mode.endswith("_truncate"):
            weights = ratio.clamp(min=settings.clip_min, max=settings.clip_max)
        else:
            weights = ratio.masked_fill(outside, 0.0)
        weights = weights.expand_as(trainer_logps)

        stat_dtype = torch.promote_types(trainer_logps.dtype, torch.float32)
        token_ratio = torch.exp(diff)
        kl = torch.where(scored, token_ratio - 1 - diff, zero)
        abs_diff = torch.where(scored, diff.abs(), zero)
        unit_weights = weights[:, :1] if settings.sequence_level else weights
        big = torch.tensor(math.inf, dtype=stat_dtype, device=trainer_logps.device)
        stats = {
            "token_count": valid.sum().to(stat_dtype),
            "kl_sum": kl.sum().to(stat_dtype),
            "logp_diff_abs_sum": abs_diff.sum().to(stat_dtype),
            "logp_diff_abs_max": abs_diff.max().to(stat_dtype) if abs_diff.numel() else -big,
            "unit_count": units.sum().to(stat_dtype),
            "clipped_count": (outside & units).sum().to(stat_dtype),
            "weight_sum": torch.where(units, unit_weights, zero).sum().to(stat_dtype),
            "weight_min": torch.where(units, unit_weights.to(stat_dtype), big).min() if units.numel() else big,
            "weight_max": torch.where(units, unit_weights.to(stat_dtype), -big).max() if units.numel() else -big,
        }
    return ImportanceWeights(weights=weights, stats=stats)


def merge_stats(into: dict[str, Tensor], stats: dict[str, Tensor]) -> None:
    """Fold one micro-batch's ``stats`` into ``into`` (sums and counts add, ``_min``/``_max`` keep the extreme)."""
    for key, value in stats.items():
        if key not in into:
            into[key] = value
        elif key.endswith("_min"):
            into[key] = torch.minimum(into[key], value)
        elif key.endswith("_max"):
            into[key] = torch.maximum(into[key], value)
        else:
            into[key] = into[key] + value


def reduce_stats(
    stats: dict[str, Tensor], reduce: Callable[[dict[str, Tensor], str], dict[str, float]]
) -> dict[str, float]:
    """Combine the stats of all ranks with ``reduce(values, op)`` (e.g. ``Ranks.sum_scalars``): sums and
    counts add, ``_max`` keys take the maximum and ``_min`` keys the minimum (as a max of negatives)."""
    extreme = ("_max", "_min")
    out = reduce({k: v for k, v in stats.items() if not k.endswith(extreme)}, "sum")
    signs = {k: -1.0 if k.endswith("_min") else 1.0 for k in stats if k.endswith(extreme)}
    largest = reduce({k: stats[k] * sign for k, sign in signs.items()}, "max")
    out.update({k: largest[k] * sign for k, sign in signs.items()})
    return out


def importance_sampling_metrics(stats: dict[str, Tensor | float]) -> dict[str, float]:
    """Mismatch metrics (TRL's ``sampling/*`` names where TRL has them) from summed/reduced stats."""
    value = {k: float(v) for k, v in stats.items()}
    tokens, units = max(value["token_count"], 1.0), max(value["unit_count"], 1.0)
    has_units = value["unit_count"] > 0
    return {
        "sampling/kl": value["kl_sum"] / tokens,
        "sampling/sampling_logp_difference/mean": value["logp_diff_abs_sum"] / tokens,
        "sampling/sampling_logp_difference/max": max(value["logp_diff_abs_max"], 0.0),
        "sampling/importance_sampling_ratio/mean": value["weight_sum"] / units,
        "sampling/importance_sampling_ratio/min": value["weight_min"] if has_units else 0.0,
        "sampling/importance_sampling_ratio/max": value["weight_max"] if has_units else 0.0,
        "sampling/importance_sampling_clipped_fraction": value["clipped_count"] / units,
    }
