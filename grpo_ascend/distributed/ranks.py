"""Rank-wide reductions over accelerate's process group, written once (single process: no collectives)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class Ranks:
    """This process's place among the training processes and the few collectives the trainers use."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def gather(self, value: Tensor) -> Tensor:
        """Every rank's ``value`` concatenated along dim 0, in rank order."""
        return self.accelerator.gather(value) if self.world > 1 else value

    def reduce(self, value: Tensor, op: str = "sum") -> Tensor:
        """``value`` reduced elementwise over ranks (``op``: sum, mean or max)."""
        return self.accelerator.reduce(value, reduction=op) if self.world > 1 else value

    def sum_scalars(self, values: dict[str, Tensor], op: str = "sum") -> dict[str, float]:
        """Reduce scalar tensors over ranks with one collective, then one host copy."""
        if not values:
            return {}
        keys = list(values)
        stacked = torch.stack([values[k].detach().float().reshape(()) for k in keys])
        return dict(zip(keys, self.reduce(stacked, op).tolist()))

    def any(self, flag: Tensor) -> bool:
        """Whether ``flag`` (a bool scalar tensor) holds on at least one rank."""
        return bool(self.reduce(flag.float().reshape(1), "max")[0] > 0)

    def mean_over_ranks(self, local: dict[str, float]) -> dict[str, float]:
        """Mean over the ranks that have each name (names may differ between ranks; all ranks must call)."""
        names = sorted(local)
        if self.world > 1:
            from accelerate.utils import gather_object

            names = sorted({name for part in gather_object([names]) for name in part})
        if not names:
            return {}
        values = torch.tensor([local.get(n, float("nan")) for n in names], device=self.accelerator.device)
        gathered = self.gather(values.reshape(1, -1)).reshape(-1, len(names))
        return dict(zip(names, torch.nanmean(gathered, dim=0).tolist()))
