"""Distributed engines behind one interface: plain/DDP, DeepSpeed ZeRO-1/2/3, FSDP2.

:func:`~grpo_ascend.distributed.launch.make_accelerator` starts accelerate;
:func:`~grpo_ascend.distributed.launch.select_strategy` picks the
:class:`~grpo_ascend.distributed.base.Strategy` once; the trainer then calls the strategy and never asks
which engine runs. Each engine's private internals live in its ``compat_*`` module.
"""
