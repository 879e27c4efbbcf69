"""RewardOutput: one batch's rewards per function and combined, and their logging metrics."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RewardOutput:
    """Rewards for one batch of N completions from F functions.

    ``per_function`` [N, F] float32 raw rewards (NaN where a function returned None), ``total`` [N]
    the weighted sum ignoring NaN (0 for a completion no function applied to; ``all_none`` counts
    them), ``error_counts`` per function the completions scored 0 under ``reward_errors="zero"``,
    ``seconds`` the wall time spent per function.
    """

    per_function: torch.Tensor
    total: torch.Tensor
    names: list[str]
    error_counts: dict[str, int]
    seconds: dict[str, float]
    all_none: int = 0

    def metrics(self) -> dict[str, float]:
        """Scalar logging metrics in TRL's naming: ``rewards/<name>/mean`` and ``/std`` (ignoring
        NaN), ``reward`` and ``reward_std`` of the total, plus per-function errors and seconds.
        One device-to-host copy."""
        values = torch.cat([self.per_function.float(), self.total.float()[:, None]], dim=1)
        valid = ~torch.isnan(values)
        count = valid.sum(dim=0)
        filled = torch.where(valid, values, torch.zeros_like(values))
        mean = filled.sum(dim=0) / count.clamp(min=1)
        squared = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values)).sum(dim=0)
        std = (squared / (count - 1).clamp(min=1)).sqrt()
        mean = torch.where(count > 0, mean, torch.full_like(mean, float("nan")))
        stats = torch.stack([mean, std]).tolist()
        out: dict[str, float] = {}
        for j, name in enumerate(self.names):
            out[f"rewards/{name}/mean"] = stats[0][j]
            out[f"rewards/{name}/std"] = stats[1][j]
            out[f"rewards/{name}/errors"] = float(self.error_counts.get(name, 0))
            out[f"rewards/{name}/seconds"] = self.seconds.get(name, 0.0)
        out["reward"] = stats[0][-1]
        out["reward_std"] = stats[1][-1]
        return out
