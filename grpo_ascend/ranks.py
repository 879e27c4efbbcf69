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
