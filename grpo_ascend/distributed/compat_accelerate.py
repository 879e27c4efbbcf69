"""The accelerate internals grpo-ascend relies on, in one place (pinned to accelerate 1.15).

- the launcher's environment flags (``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_USE_FSDP``),
  read the way accelerate's own state reads them;
- switching CPU processes to FSDP: accelerate 1.15 turns its FSDP plugin on only for accelerator
  processes and silently runs CPU (gloo) processes as plain data parallelism; FSDP2 itself runs on
  the CPU, so the state is set as accelerate sets it on a device. That writes ``PartialState``'s
  shared state and ``AcceleratorState.fsdp_plugin``;
- the plugin fields the strategies read or set.

:data:`PINNED_INTERNALS` lists each with a probe; tests/distributed/test_compat.py runs every probe, so an
accelerate release that changes one fails there with a :class:`CompatError` naming it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import Any

from grpo_ascend.errors import CompatError

DEEPSPEED_ENV = "ACCELERATE_USE_DEEPSPEED"
FSDP_ENV = "ACCELERATE_USE_FSDP"
FSDP_PLUGIN_FIELDS = ("fsdp_version", "activation_checkpointing", "cpu_offload", "cpu_ram_efficient_loading",
                      "mixed_precision_policy", "auto_wrap_policy", "transformer_cls_names_to_wrap")


def _changed(what: str) -> CompatError:
    import accelerate

    return CompatError(f"accelerate {accelerate.__version__} changed {what}, which grpo-ascend relies on; use "
                       "accelerate 1.15 (or update grpo_ascend/distributed/compat_accelerate.py)")


def _reads_env(module: Any, name: str) -> None:
    if name not in inspect.getsource(module):
        raise _changed(f"the launcher environment flag {name} (no longer read by {module.__name__})")


def _has_fields(cls: type, names: tuple[str, ...]) -> None:
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = [n for n in names if n not in fields]
    if missing:
        raise _changed(f"the field(s) {', '.join(missing)} of {cls.__name__}")


def _has_attribute(cls: type, name: str) -> None:
    if not hasattr(cls, name):
        raise _changed(f"{cls.__name__}.{name}")


def _sets_attribute(cls: type, name: str) -> None:
    """``cls`` has (or its code sets) the instance attribute ``name``."""
    if not hasattr(cls, name) and f"self.{name}" not in inspect.getsource(cls):
        raise _changed(f"{cls.__name__}.{name}")


def _probe_partial_state() -> None:
    from accelerate.state import PartialState

    _has_attribute(PartialState, "_shared_state")  # distributed_type lives in the shared state
    _sets_attribute(PartialState, "distributed_type")


def _probe_accelerator_state() -> None:
    from accelerate.state import AcceleratorState

    for name in ("fsdp_plugin", "deepspeed_plugin"):
        _sets_attribute(AcceleratorState, name)


def _state_module() -> Any:
    import accelerate.state

    return accelerate.state


def _plugin(name: str) -> type:
    import accelerate.utils

    return getattr(accelerate.utils, name)


#: name -> probe; each raises CompatError naming the internal when the installed accelerate changed it.
PINNED_INTERNALS: dict[str, Callable[[], None]] = {
    f"env {DEEPSPEED_ENV}": lambda: _reads_env(_state_module(), DEEPSPEED_ENV),
    f"env {FSDP_ENV}": lambda: _reads_env(_state_module(), FSDP_ENV),
    "PartialState.distributed_type": _probe_partial_state,
    "AcceleratorState.fsdp_plugin/deepspeed_plugin": _probe_accelerator_state,
    "FullyShardedDataParallelPlugin fields": lambda: _has_fields(_plugin("FullyShardedDataParallelPlugin"),
                                                                  FSDP_PLUGIN_FIELDS),
    "FullyShardedDataParallelPlugin.set_mixed_precision": lambda: _has_attribute(
        _plugin("FullyShardedDataParallelPlugin"), "set_mixed_precision"),
    "DeepSpeedPlugin fields": lambda: _has_fields(_plugin("DeepSpeedPlugin"), ("zero_stage", "hf_ds_config")),
    "DeepSpeedPlugin.deepspeed_config": lambda: _sets_attribute(_plugin("DeepSpeedPlugin"), "deepspeed_config"),
}


def flag(name: str) -> bool:
    """A launcher flag (``accelerate launch`` sets these from its config), read as accelerate reads it."""
    return os.environ.get(name, "false").lower() == "true"


def deepspeed_requested() -> bool:
    """Whether ``accelerate launch`` was told to use DeepSpeed (its config or ``--use_deepspeed``)."""
    return flag(DEEPSPEED_ENV)


def fsdp_requested() -> bool:
    """Whether ``accelerate launch`` was told to use FSDP (its config or ``--use_fsdp``)."""
    return flag(FSDP_ENV)


def switch_cpu_processes_to_fsdp(accelerator: Any) -> bool:
    """Switch accelerate's state to FSDP for CPU processes launched with an FSDP config; returns whether it did."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if not fsdp_requested() or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    # AcceleratorState copies PartialState's fields whenever it is instantiated again: set both.
    process = PartialState()
    if process.distributed_type == DistributedType.MULTI_CPU:
        process.distributed_type = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    return True
