"""Which tokens the policy-gradient term trains on: the off-policy sequence mask and the high-entropy tokens.

Both are TRL 1.16's rules, as 0/1 masks that multiply the per-token policy term; neither changes the
loss normalisers (a dropped token still counts in a loss type's token or sequence totals, as in TRL).

* :func:`off_policy_sequence_mask` (DeepSeek-V3.2, ``off_policy_mask_threshold`` δ): a sequence with a
  negative advantage whose mean per-token KL(π_sampler ‖ π_θ) estimate, mean_t (logp_sampler − logp_θ), is
  above δ is dropped; every other sequence is kept.
* :func:`high_entropy_mask` (Beyond the 80/20 Rule, ``top_entropy_quantile`` ρ): only tokens whose
  entropy is at least the (1 − ρ) quantile of the valid tokens' entropies (over all ranks) are kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_ascend.errors import ConfigError


def off_policy_sequence_mask(
    advantages: Tensor, logps: Tensor, sampling_logps: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """1.0 where a sequence is kept, 0.0 where dropped; ``[B, 1]`` for ``[B]``/``[B, 1]`` advantages.

    ``logps`` are the current policy's (detached here), ``sampling_logps`` the sampler's, ``mask`` the
    valid completion tokens [B, T]. NaN log-prob differences (unscorable tokens) count as 0.
    """
    m = mask.to(logps.dtype)
    diff = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_kl = (diff * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    return ((adv >= 0) | (mean_kl <= threshold)).to(logps.dtype)


def check_quantile(top_entropy_quantile: float) -> None:
    """ConfigError unless ``top_entropy_quantile`` is in [0, 1]."""
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ConfigError(
            f"top_entropy_quantile must be in [0, 1] (1 keeps every token, 0.2 the top 20% by entropy), "
            f"got {top_entropy_quantile!r}"
        )


def high_entropy_mask(
    entropies: Tensor, mask: Tensor, top_entropy_quantile: float,
    gather: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Bool [B, T]: valid tokens whose entropy is >= the (1 − ρ) quantile of all valid tokens' entropies.

    ρ = 1 keeps every valid token; ρ = 0 keeps the highest-entropy token(s) only. ``gather`` as for
    :func:`entropy_quantile_mask`.
    """
    check_quantile(top_entropy_quantile)
    return entropy_quantile_mask(entropies, mask, 1.0 - top_entropy_quantile, gather)


def entropy_quantile_mask(
    entropies: Tensor, mask: Tensor, quantile: float, gather: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Bool [B, T]: valid tokens whose entropy is >= the ``quantile`` quantile (in [0, 1]) of the valid tokens'
    entropies (TRL's ``get_high_entropy_mask`` threshold: 0 keeps every valid token, 0.8 the top 20%).

    ``gather`` collects the valid entropies of every rank (a 1-D tensor each, padded to one length with
    a negative sentinel, which is dropped again: entropies are never negative); None = this rank alone.
    No valid token anywhere gives an all-False mask.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ConfigError(f"the entropy quantile threshold must be in [0, 1] (0 keeps every valid token, 0.8 the "
                          f"top 20% by entropy), got {quantile!r}")
    valid = mask.bool()
    local = entropies.detach()[valid].float()
    pooled = local if gather is None else gather(local)
    pooled = pooled[pooled >= 0]
    if pooled.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(pooled, quantile)
    return (entropies.detach() >= threshold) & valid  # a 0-dim threshold takes the entropies' dtype, as TRL's
