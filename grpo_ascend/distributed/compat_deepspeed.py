"""The DeepSpeed internals grpo-ascend relies on, in one place (pinned to DeepSpeed 0.19).

Everything the DeepSpeed strategy calls beyond ``accelerate.prepare`` goes through here: the
ZeRO-3 gather helpers, the engine's accumulation boundary, backward without accumulation
scaling, its step outcome, and the ZeRO optimizer's state-dict layout. :data:`PINNED_INTERNALS`
lists each with a probe; tests/distributed/test_compat.py runs every probe, so a DeepSpeed release that
renames one fails there with a :class:`CompatError` naming it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from grpo_ascend.errors import CompatError


def _changed(what: str) -> CompatError:
    try:
        import deepspeed

        version = deepspeed.__version__
    except ImportError:  # pragma: no cover - only reached with DeepSpeed installed
        version = "?"
    return CompatError(f"DeepSpeed {version} changed {what}, which grpo-ascend relies on; use deepspeed 0.19 "
                       "(or update grpo_ascend/distributed/compat_deepspeed.py)")


def _attribute(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    try:
        for part in path.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        raise _changed(f"{module}.{path}") from exc
    return obj


def _signature_parameters(fn: Callable[..., Any]) -> Any:
    """The parameters of ``fn``, looking through decorators that hide them behind ``*args, **kwargs``."""
    params = inspect.signature(fn).parameters
    opaque = all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values())
    if opaque:
        for cell in fn.__closure__ or ():
            if inspect.isfunction(cell.cell_contents):
                return _signature_parameters(cell.cell_contents)
    return params


def _has_parameters(module: str, path: str, names: tuple[str, ...]) -> None:
    params = _signature_parameters(_attribute(module, path))
    missing = [n for n in names if n not in params]
    if missing:
        raise _changed(f"the parameter(s) {', '.join(missing)} of {module}.{path}")


_COMM = "deepspeed.comm.torch"  # imported by path: the attribute deepspeed.comm.torch is the torch package
_ENGINE = "deepspeed.runtime.engine"
_ZERO12 = "deepspeed.runtime.zero.stage_1_and_2"
_ZERO3 = "deepspeed.runtime.zero.stage3"
_STATE_KEYS = "deepspeed.checkpoint.constants"

#: name -> probe; each raises CompatError naming the internal when the installed DeepSpeed changed it.
PINNED_INTERNALS: dict[str, Callable[[], None]] = {
    "zero.GatheredParameters": lambda: _attribute("deepspeed", "zero.GatheredParameters"),
    "comm.torch.build_shm_op": lambda: _attribute(_COMM, "build_shm_op"),
    "zero.register_external_parameter": lambda: _attribute("deepspeed", "zero.register_external_parameter"),
    "stage3.unwrap_model_for_generation": lambda: _attribute(_ZERO3, "unwrap_model_for_generation"),
    "DeepSpeedEngine.set_gradient_accumulation_boundary": lambda: _has_parameters(
        _ENGINE, "DeepSpeedEngine.set_gradient_accumulation_boundary", ("is_boundary",)),
    "DeepSpeedEngine.backward(scale_wrt_gas)": lambda: _has_parameters(
        _ENGINE, "DeepSpeedEngine.backward", ("loss", "scale_wrt_gas")),
    "DeepSpeedEngine.get_global_grad_norm": lambda: _attribute(_ENGINE, "DeepSpeedEngine.get_global_grad_norm"),
    "DeepSpeedEngine.was_step_applied": lambda: _attribute(_ENGINE, "DeepSpeedEngine.was_step_applied"),
    "DeepSpeedZeroOptimizer(check_grad_overflow)": lambda: _has_parameters(
        _ZERO12, "DeepSpeedZeroOptimizer.__init__", ("check_grad_overflow",)),
    "DeepSpeedZeroOptimizer.load_state_dict": lambda: _has_parameters(
        _ZERO12, "DeepSpeedZeroOptimizer.load_state_dict", ("load_optimizer_states", "load_from_fp32_weights")),
    "DeepSpeedZeroOptimizer_Stage3.load_state_dict": lambda: _has_parameters(
        _ZERO3, "DeepSpeedZeroOptimizer_Stage3.load_state_dict", ("load_optimizer_states", "load_from_fp32_weights")),
    "checkpoint state keys": lambda: [_attribute(_STATE_KEYS, k) for k in ("LOSS_SCALER", "PARAM_SLICE_MAPPINGS")],
}


# ------------------------------------------------------------------------------ ZeRO-3 parameters
def is_partitioned(param: nn.Parameter) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter (DeepSpeed gives those a ``ds_id``)."""
    return hasattr(param, "ds_id")


def full_numel(param: nn.Parameter) -> int:
    """Element count of the whole parameter, partitioned or not."""
    return int(getattr(param, "ds_numel", param.numel()))


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    """The whole parameter's shape, partitioned or not (ZeRO-3 leaves an empty tensor and keeps it in ``ds_shape``)."""
    return tuple(int(d) for d in getattr(param, "ds_shape", param.shape))


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """ZeRO-3 partitioned ``params`` whole on every rank inside the block (all ranks must enter).

    ``modifier_rank=None``: read only. ``modifier_rank=R``: rank R's values are broadcast and
    partitioned on exit (what a load does). Plain parameters pass through untouched.
    """
    params = [p for p in params if is_partitioned(p)]
    if not params:
        yield
        return
    with _attribute("deepspeed", "zero.GatheredParameters")(params, modifier_rank=modifier_rank):
        yield


@contextlib.contextmanager
def unwrapped_for_generation(engine: Any) -> Iterator[None]:
    """DeepSpeed's ``unwrap_model_for_generation``: every parameter gathered, ZeRO-3's hooks removed."""
    with _attribute(_ZERO3, "unwrap_model_for_generation")(engine):
        yield


def register_external(root: nn.Module, param: nn.Parameter) -> None:
    """Gather ``param`` with ``root``'s forward, flagged as DeepSpeed flags parameters a module hands out."""
    _attribute("deepspeed", "zero.register_external_parameter")(root, param)
    param.is_external_param = True


# ------------------------------------------------------------------------------ engine
def set_accumulation_boundary(engine: Any, last: bool) -> None:
    engine.set_gradient_accumulation_boundary(last)


def backward_unscaled(engine: Any, loss: Any) -> None:
    """The engine's backward without its division by gradient_accumulation_steps."""
    engine.backward(loss, scale_wrt_gas=False)


def step_checking_overflow(engine: Any) -> tuple[float | None, bool]:
    """The engine's step with the NaN/inf check on in every precision; (global grad norm, whether applied)."""
    engine.optimizer.check_grad_overflow = True  # also under bf16/fp32, where it may be off by default
    engine.step()
    return engine.get_global_grad_norm(), bool(engine.was_step_applied())


# ------------------------------------------------------------------------------ optimizer shards
def plain_optimizer_state(zero_optimizer: Any) -> dict[str, Any]:
    """This rank's ZeRO optimizer state as plain values (readable with ``torch.load(weights_only=True)``).

    DeepSpeed's state dict holds its loss-scaler object (kept as its plain attributes) and the
    parameter-slice mappings (rebuilt by DeepSpeed at start-up, dropped here).
    """
    state = dict(zero_optimizer.state_dict())
    scaler = state.pop("loss_scaler", None)
    state.pop("param_slice_mappings", None)
    if "zero_stage" in state:
        state["zero_stage"] = int(state["zero_stage"])
    plain = (bool, int, float, str, type(None))
    state["loss_scaler_state"] = {k: v for k, v in vars(scaler).items() if isinstance(v, plain)} if scaler else {}
    return state


def load_plain_optimizer_state(zero_optimizer: Any, state: dict[str, Any], world_size: int) -> None:
    """Inverse of :func:`plain_optimizer_state`: Adam state, fp32 master partition, loss scale."""
    scaler_state = state.pop("loss_scaler_state", {})
    state.setdefault("loss_scaler", zero_optimizer.loss_scaler)  # ZeRO-3 reads it back; values set below
    # DeepSpeed indexes the list by data-parallel rank; only this rank's entry is read.
    zero_optimizer.load_state_dict([state] * world_size, load_optimizer_states=True, load_from_fp32_weights=True)
    for key, value in scaler_state.items():
        setattr(zero_optimizer.loss_scaler, key, value)


def skip_shared_memory_allreduce_build() -> None:
    """Start DeepSpeed's process group without building its CPU shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed compiles that C++ op (ninja, 1.5-5 minutes on 2 cores, again for every
    new environment) when its process group starts. Only DeepSpeed's inference all-reduce uses it; training's
    collectives go through torch.distributed, so a training run never needs it. Other accelerators build nothing.
    """
    comm = importlib.import_module(_COMM)
    _attribute(_COMM, "build_shm_op")
    comm.build_shm_op = lambda: None
