"""KL-penalty coefficient controllers for PPO's token rewards r_t = score·[t = last] − β·(log π − log π_ref).

* ``fixed``: β stays at ``kl_coef``.
* ``adaptive`` (Ziegler et al., 2019, "Fine-Tuning Language Models from Human Preferences"): after
  each rollout batch with mean per-sequence KL ``kl`` over ``n`` sequences,
  β ← β · (1 + clip(kl / target − 1, −0.2, 0.2) · n / horizon), a proportional controller that
  steers the KL towards ``target``.

Controllers are plain Python state (one float); ``state_dict`` / ``load_state_dict`` let
checkpoints restore β exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.algorithms.registry import Registry
from grpo_ascend.errors import ConfigError, DataError

KL_CONTROLLERS: Registry[type[KLController]] = Registry("kl controller")


@dataclass
class KLController:
    """A fixed coefficient: ``value`` is β; ``update`` does nothing."""

    value: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value) and self.value >= 0):
            raise ConfigError(f"kl_coef must be a finite number >= 0, got {self.value!r}")

    def update(self, current_kl: float, n_steps: int) -> float:
        """Account for a rollout batch of ``n_steps`` sequences with mean KL ``current_kl``; returns β."""
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


KL_CONTROLLERS.register("fixed")(KLController)


@KL_CONTROLLERS.register("adaptive")
@dataclass
class AdaptiveKLController(KLController):
    """Proportional controller towards ``target`` KL (sum over a sequence's tokens), see the module docstring."""

    target: float = 6.0
    horizon: int = 10000

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.target > 0:
            raise ConfigError(f"target_kl must be > 0 for the adaptive KL controller, got {self.target!r}")
        if not self.horizon > 0:
            raise ConfigError(f"kl_horizon must be > 0, got {self.horizon!r}")

    def update(self, current_kl: float, n_steps: int) -> float:
        if not math.isfinite(current_kl):
            return self.value  # a NaN/inf batch must not poison β
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


def make_kl_controller(kl_coef: float, adaptive: bool = False, target_kl: float = 6.0,
                       kl_horizon: int = 10000) -> KLController:
    """The controller PPOConfig asks for (``adaptive_kl`` picks the proportional one)."""
    if adaptive:
        return AdaptiveKLController(kl_coef, target=target_kl, horizon=kl_horizon)
    return KLController(kl_coef)


def token_rewards(
    scores: Tensor, logps: Tensor, ref_logps: Tensor | None, mask: Tensor, kl_coef: float
) -> tuple[Tensor, Tensor]:
    """PPO's per-token rewards [B, T] and the per-token KL estimate (k1 = log π − log π_ref) [B, T].

    r_t = −kl_coef·(log π − log π_ref)_t on every valid token, plus ``scores[b]`` on the last valid
    token of row b (right-padded rows; a row with no valid token gets nothing). ``ref_logps=None``
    means no KL term. Masked positions are 0 in both outputs.
    """
    if logps.dim() != 2 or mask.shape != logps.shape:
        raise DataError(f"logps and mask must both be [B, T], got {tuple(logps.shape)} and {tuple(mask.shape)}")
    if scores.shape != logps.shape[:1]:
        raise DataError(f"scores must be [B] = {tuple(logps.shape[:1])}, got {tuple(scores.shape)}")
    m = mask.to(torch.float32)
    kl = torch.zeros_like(m) if ref_logps is None else (logps.float() - ref_logps.float()) * m
    lengths = m.sum(1)
    last = (lengths - 1).clamp(min=0).long().unsqueeze(1)
    score = (scores.float() * (lengths > 0)).unsqueeze(1)
    return (-kl_coef * kl).scatter_add(1, last, score), kl
