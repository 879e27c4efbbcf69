"""Distributed engines behind one interface: plain/DDP, DeepSpeed ZeRO-1/2/3, FSDP2.

:func:`make_accelerator` starts accelerate; :func:`select_strategy` picks the
:class:`~grpo_ascend.distributed.base.Strategy` once; the trainer then calls the strategy and never asks
which engine runs. Each engine's private internals live in its ``compat_*`` module.
"""

from grpo_ascend.distributed.base import SaveState, Strategy
from grpo_ascend.distributed.launch import make_accelerator, select_strategy

__all__ = ["SaveState", "Strategy", "make_accelerator", "select_strategy"]
