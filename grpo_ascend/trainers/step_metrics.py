"""Statistics of one optimizer step: micro-batch sums kept on the device, and the per-token averages
of the policy-loss statistics logged for the step."""

from __future__ import annotations

from torch import Tensor


def accumulate(sums: dict[str, Tensor], values: dict[str, Tensor]) -> None:
    """Add detached micro-batch statistics into ``sums`` (kept on the device, no host sync)."""
    for k, v in values.items():
        sums[k] = sums[k] + v.detach() if k in sums else v.detach().clone()


def policy_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Per-token averages of the policy-loss statistics summed over a step and all ranks."""
    n_tok = max(totals.get("token_count", 0.0), 1.0)
    return {
        "entropy": totals.get("entropy_sum", 0.0) / n_tok,
        "clip_ratio/low": totals.get("clipped_low", 0.0) / n_tok,
        "clip_ratio/high": totals.get("clipped_high", 0.0) / n_tok,
        "clip_ratio/region": totals.get("clipped_region", 0.0) / n_tok,
        "ratio/mean": totals.get("ratio_sum", 0.0) / n_tok,
    }
