"""One process, or plain data parallelism (accelerate's DDP): every rank holds the whole model."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend.distributed.base import SaveState, Strategy


class PlainStrategy(Strategy):
    """accelerate's own prepare, ``no_sync`` and backward; clip, agree on NaN/inf, step."""

    name = "plain"

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                policy: nn.Module) -> tuple[nn.Module, Any]:
        return self.accelerator.prepare(model, optimizer)

    def no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.accelerator.no_sync(model)

    def backward(self, model: nn.Module, loss: Tensor) -> None:
        self.accelerator.backward(loss)

    def grad_norm(self, params: list[nn.Parameter]) -> Tensor:
        """Pre-clipping global gradient norm of ``params``, clipping them to ``max_grad_norm`` if set."""
        max_norm = self.args.max_grad_norm
        if max_norm and max_norm > 0:
            return self.accelerator.clip_grad_norm_(params, max_norm)
        grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
        return torch.stack(grads).norm() if grads else torch.zeros((), device=self.device)

    def clip_and_step(self, model: nn.Module, optimizer: Any, params: list[nn.Parameter],
                      loss_finite: Tensor) -> tuple[float, bool]:
        grad_norm = torch.as_tensor(self.grad_norm(params), device=self.device).float()
        if self.world_size > 1:
            # The averaged gradient is the same on every rank but the loss is not: all ranks must
            # agree to step or to skip, or their weights drift apart.
            loss_finite = self.accelerator.reduce((~loss_finite).float().reshape(1), reduction="max")[0] == 0
        finite = bool(torch.isfinite(grad_norm) & loss_finite)
        if finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), finite

    def save_state(self, module: nn.Module, optimizer: Any, output_dir: str | Path, step: int) -> SaveState:
        return SaveState(optimizer=getattr(optimizer, "optimizer", optimizer))
