"""Starting accelerate for a run and choosing its distributed strategy, once.

:func:`make_accelerator` reads the launcher's environment (a single process, ``accelerate
launch`` / ``grpo-ascend train --num_processes N``, DeepSpeed or FSDP configs) and builds the
Accelerator on the requested device; :func:`select_strategy` maps accelerate's distributed type
to the strategy that drives it (:data:`STRATEGIES`), validating the launch on the way.
"""

from __future__ import annotations

import os
from typing import Any

from grpo_ascend import device as dev
from grpo_ascend.distributed import compat_accelerate, compat_deepspeed
from grpo_ascend.distributed.base import Strategy, StrategyArgs
from grpo_ascend.distributed.deepspeed import DeepSpeedStrategy
from grpo_ascend.distributed.fsdp import FSDPStrategy
from grpo_ascend.distributed.plain import PlainStrategy
from grpo_ascend.errors import ConfigError


def launched_distributed(on_cpu: bool) -> bool:
    """Whether accelerate will start a process group here (mirrors its own test of the launcher env)."""
    if int(os.environ.get("LOCAL_RANK", "-1")) != -1:
        return True
    sizes = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE")
    return on_cpu and any(int(os.environ.get(name, "1")) > 1 for name in sizes)


def precision_of(args: StrategyArgs, device: Any) -> str:
    """'bf16', 'fp16' or 'fp32': bf16 by default on an accelerator that supports it."""
    return dev.run_precision(device, args.bf16, args.fp16)


def make_accelerator(args: StrategyArgs) -> tuple[Any, str]:
    """The run's Accelerator on ``args.device`` and its precision ('bf16', 'fp16' or 'fp32')."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    requested = dev.resolve_device(args.device)  # fails clearly if the device is unusable
    precision = precision_of(args, requested)
    on_cpu = dev.device_type(requested) == "cpu"
    # The collective backend comes from the device layer; accelerate would pick the same one on
    # accelerators, but on the CPU it prefers MPI when torch has it. It may only be named when a
    # launcher started several processes (accelerate refuses a backend for a single process).
    group = InitProcessGroupKwargs(timeout=dev.apply_collective_timeouts(requested, args.ddp_timeout))
    if launched_distributed(on_cpu):
        group.backend = dev.dist_backend(requested)
    kwargs: dict[str, Any] = {
        "mixed_precision": dev.mixed_precision_for_accelerate(precision == "bf16", args.fp16),
        # accelerate ignores its engine launch settings when told cpu=True; on the CPU it then
        # picks the CPU device by itself (and the engine its CPU accelerator).
        "cpu": on_cpu and not (compat_accelerate.deepspeed_requested() and launched_distributed(on_cpu)),
        "kwargs_handlers": [group],
    }
    if compat_accelerate.deepspeed_requested():
        compat_deepspeed.skip_shared_memory_allreduce_build()
    accelerator = Accelerator(**kwargs)
    if dev.device_type(accelerator.device) != dev.device_type(requested):
        raise ConfigError(
            f"accelerate chose device {accelerator.device} but {args.device!r} was requested; "
            "check the accelerate config (accelerate env) or the device setting"
        )
    compat_accelerate.switch_cpu_processes_to_fsdp(accelerator)
    return accelerator, precision


#: accelerate's distributed type (its value) -> strategy; any other type runs the plain/DDP strategy.
STRATEGIES: dict[str, type[Strategy]] = {"DEEPSPEED": DeepSpeedStrategy, "FSDP": FSDPStrategy}


def select_strategy(accelerator: Any, args: StrategyArgs, precision: str, trainer_name: str,
                    prepared_models: int = 1) -> Strategy:
    """The strategy for accelerate's distributed type; refuses a launch it can't run (ConfigError)."""
    kind = getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))
    cls = STRATEGIES.get(kind, PlainStrategy)
    return cls(accelerator, args, precision, trainer_name, prepared_models)
