"""Per-token estimators of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman, "Approximating KL divergence").

With ``x = ref_logp − logp`` (the log of r = π_ref/π_θ at the sampled token):

* ``k1 = −x``                 unbiased, high variance, can be negative;
* ``k2 = x² / 2``             biased, low variance, always >= 0;
* ``k3 = exp(x) − x − 1``     unbiased, low variance, always >= 0 (DeepSeekMath's GRPO, TRL's only choice).

Each takes the current log-probs (with grad) and the reference log-probs, both ``[B, T]``, and
returns the per-token estimate; the caller masks and aggregates it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_ascend.algorithms.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("kl_estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k1 = log π_θ − log π_ref."""
    return logps - ref_logps


@KL_ESTIMATORS.register("k2")
def kl_k2(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k2 = ½ (log π_ref − log π_θ)²."""
    return 0.5 * (ref_logps - logps) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """k3 = π_ref/π_θ − log(π_ref/π_θ) − 1."""
    x = ref_logps - logps
    return torch.exp(x) - x - 1


def per_token_kl(estimator: str, logps: Tensor, ref_logps: Tensor) -> Tensor:
    """The estimator registered as ``estimator`` applied token-wise (ConfigError naming the valid ones)."""
    return KL_ESTIMATORS.get(estimator)(logps, ref_logps)
