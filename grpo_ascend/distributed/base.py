"""The strategy interface: everything a distributed engine changes about training, behind one object.

The trainer builds one strategy (:func:`grpo_ascend.distributed.select_strategy`) right after accelerate
and then calls it; it never asks which engine runs. The calls, in the order a run makes them:

=========================  ====================================================================
``parameter_numel``        a parameter's whole size, also when the engine partitioned it at load
``memory_layout``          where weights, gradients and optimizer state live (the memory plan's input)
``validate_model``         refuse a model the engine can't train (e.g. full fine-tuning, ZeRO-3)
``configure``              before prepare: fill the engine's config from the run's batch plan
``unsharded_reference``    a whole frozen reference copy when the engine will shard the policy
``prepare``                wrap the log-prob model and optimizer (accelerate's prepare + extras)
``prepare_critic``         wrap PPO's critic (its own data-parallel wrapper)
``fixed_calls``            whether every rank must make the same module calls in a forward
``may_merge_lora``         whether rollouts may fold LoRA into the (engine-owned) weights
``may_fuse_lora``          whether LoRA layers may run the fused kernel, which reads their weights itself
``whole_weights``          context: the whole policy on every rank for a generation round
``full_shape``             a tensor's whole shape, read without gathering (a transfer's manifest)
``stream_whole``           the policy's tensors whole one at a time, for a sampler holding its own copy
``no_sync``                context: one micro-batch, gradient all-reduce only on the last
``backward``               backward of an already normalised micro-batch loss
``clip_and_step``          clip, NaN/inf check agreed by all ranks, step or skip; zero the grads
``gathered``               context: the given (partitioned) parameters whole on every rank
``save_state``             collective part of a checkpoint save (shards, gathered weights)
``loading``                context around reading a checkpoint into the live weights
``optimizer_to_load``      which optimizer the checkpoint loader restores (None: the engine's own)
``after_load``             the engine's own part of a resume (its optimizer shard, resharding)
``export_source``          what the end-of-run export reads (the live model or the checkpoint)
=========================  ====================================================================

Validation of the launch itself (what the engine refuses whatever the model) happens when the
strategy is built.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from grpo_ascend.distributed.memory_layout import MemoryLayout, plain_layout


class StrategyArgs(Protocol):
    """The run config's settings a strategy reads (grpo_ascend.config's BaseRLConfig has them): declared here so
    that distributed/ does not import config/, whose TRL tables import distributed/trl_config.py."""

    device: str
    bf16: bool | None
    fp16: bool
    ddp_timeout: int
    max_grad_norm: float
    per_device_train_batch_size: int


class StepPlan(Protocol):
    """What a strategy reads from the run's batch plan (grpo_ascend.config's BatchPlan)."""

    grad_accum: int


@dataclass
class SaveState:
    """What a checkpoint save needs from the engine, after every rank took part in collecting it.

    ``optimizer``: an object whose ``state_dict()`` is written, or None when each rank already
    wrote its own shard into ``staging_dir`` (``optimizer_shards`` of them). ``trainable_weights``:
    the trainable parameters by name when the model's own are sharded (main rank only).
    """

    optimizer: Any = None
    staging_dir: str | None = None
    optimizer_shards: int | None = None
    trainable_weights: dict[str, Tensor] | None = None


class Strategy(abc.ABC):
    """One distributed engine's way to prepare, step, gather and checkpoint (see the module docstring).

    ``prepared_models``: how many models the trainer hands to accelerate (GRPO 1, PPO 2: policy and
    critic); engines that take one model per run refuse more.
    """

    #: Short engine name for logs and metrics.
    name: str = ""

    def __init__(self, accelerator: Any, args: StrategyArgs, precision: str, trainer_name: str,
                 prepared_models: int = 1):
        self.accelerator = accelerator
        self.args = args
        self.precision = precision
        self.validate(trainer_name, prepared_models)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    def parameter_numel(self, param: nn.Parameter) -> int:
        """The number of elements of ``param`` whole (an engine may hold only this rank's part of it)."""
        return param.numel()

    def memory_layout(self) -> MemoryLayout:
        """Where this engine keeps weights, gradients and optimizer state (for the memory plan)."""
        return plain_layout(self.world_size)

    # ------------------------------------------------------------------ validation and setup
    def validate(self, trainer_name: str, prepared_models: int) -> None:
        """Refuse a launch the engine can't run correctly (ConfigError); called once, when built."""
        return None  # nothing to do by default

    def validate_model(self, is_peft: bool) -> None:
        """Refuse a model the engine can't train (ConfigError); called once the policy is loaded."""
        return None  # nothing to do by default

    def configure(self, policy: nn.Module, plan: StepPlan) -> None:
        """Before :meth:`prepare`: set the engine's config from the run's batch plan and the policy."""
        return None  # nothing to do by default

    def unsharded_reference(self, policy: nn.Module, is_peft: bool, wants_reference: bool) -> nn.Module | None:
        """A whole frozen copy of the policy for the reference forward, when the engine will shard it."""
        return None

    @abc.abstractmethod
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                policy: nn.Module) -> tuple[nn.Module, Any]:
        """Wrap the log-prob ``model`` (around ``policy``) and the optimizer for this engine."""

    def prepare_critic(self, critic: nn.Module) -> nn.Module:
        """Wrap PPO's critic after :meth:`prepare`: a data-parallel wrapper of its own over exactly its
        trainable parameters (the policy's wrapper was made without them)."""
        return self.accelerator.prepare(critic)

    @property
    def fixed_calls(self) -> bool:
        """Whether every rank must make the same module calls in a log-prob forward, whatever its batch
        holds (engines that gather parameters inside each module call): micro-batches then run at the
        widest completion over ranks."""
        return False

    # ------------------------------------------------------------------ rollouts
    def may_merge_lora(self, wanted: bool | None, is_peft: bool) -> bool:
        """Whether rollouts may fold LoRA into the weights (False when the engine owns their storage)."""
        return True

    def may_fuse_lora(self) -> bool:
        """Whether LoRA layers may run :mod:`grpo_ascend.models.lora_kernel`, which reads the base and adapter
        weights inside the LoRA layer's call (False when the engine gathers each submodule's
        parameters in that submodule's own forward hook)."""
        return True

    def whole_weights(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The whole policy on every rank for one generation round (all ranks must enter)."""
        return contextlib.nullcontext()

    def full_shape(self, tensor: Tensor) -> tuple[int, ...]:
        """``tensor``'s whole shape, read without gathering anything (an engine may hold only a slice of it)."""
        return tuple(tensor.shape)

    def stream_whole(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """``named`` (a state dict's items, as the live parameters) whole, one tensor at a time.

        For a sampler that holds its own copy of the weights (a server, the rollout process): a sharded engine
        gathers each tensor when it is asked for and frees it when the next one is, so no rank ever holds more
        than one whole tensor beside its shards. Collective: every rank iterates to the end, in the same order."""
        for name, tensor in named:
            yield name, tensor.detach()

    # ------------------------------------------------------------------ one optimizer step
    @abc.abstractmethod
    def no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """One micro-batch's forward and backward: gradients are reduced over ranks only when ``last``."""

    @abc.abstractmethod
    def backward(self, model: nn.Module, loss: Tensor) -> None:
        """Backward of a micro-batch loss already normalised for the whole step (no further scaling)."""

    @abc.abstractmethod
    def clip_and_step(self, model: nn.Module, optimizer: Any, params: list[nn.Parameter],
                      loss_finite: Tensor) -> tuple[float, bool]:
        """Clip to ``max_grad_norm``, then step unless the loss or gradient is NaN/inf on any rank.

        Returns (pre-clipping global gradient norm, whether the step was taken); every rank returns
        the same decision. The gradients are zeroed either way; the LR schedule is the caller's.
        """

    # ------------------------------------------------------------------ whole parameters
    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
        """``params`` whole on every rank inside the block (all ranks must enter).

        ``modifier_rank=R``: rank R's values are kept and redistributed on exit (a load).
        """
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ checkpoints
    @abc.abstractmethod
    def save_state(self, module: nn.Module, optimizer: Any, output_dir: str | Path, step: int) -> SaveState:
        """The collective part of a save (all ranks call it): optimizer state and weights to write."""

    def loading(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Context around reading a checkpoint's weights into ``module`` (all ranks enter)."""
        return contextlib.nullcontext()

    def optimizer_to_load(self, optimizer: Any) -> Any:
        """The optimizer whose state the checkpoint loader restores; None when :meth:`after_load` does it."""
        return getattr(optimizer, "optimizer", optimizer)

    def after_load(self, path: Path, optimizer: Any) -> None:
        """The engine's own part of a resume, after the weights and the shared state were read."""
        return None  # nothing to do by default

    def export_source(self, policy: nn.Module, last_checkpoint: Path) -> nn.Module | Path:
        """What the end-of-run export reads: the live policy, or the checkpoint saved just before."""
        return policy
