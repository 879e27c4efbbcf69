"""FSDP2 behind accelerate (``distributed_type: FSDP``, ``fsdp_version: 2``) for the GRPO trainer.

accelerate shards the prepared :class:`~grpo_ascend.models.policy.CompletionLogprobs` with
``fully_shard``: one unit per decoder layer (``transformer_cls_names_to_wrap``, by default the
model's ``_no_split_modules``) and the root holding the embeddings, final norm and LM head. The
training forwards all enter through the root (its pre-forward hook gathers the root's weights
before the backbone and head run, and each layer gathers its own, also when the backbone runs
twice for a shared prompt prefix). What this strategy adds around that:

- every rank makes the same decoder calls in the log-prob forward (``fixed_calls``), since each
  call all-gathers a layer;
- rollouts: the engine calls the policy token by token, below the root, so every unit is gathered
  once before generation and resharded afterwards (:mod:`grpo_ascend.distributed.compat_fsdp2`);
- gradient norm: the gradients are sharded ``DTensor`` s; their global norm is reduced over ranks;
- checkpoints: the trainable weights and the Adam state are gathered to whole tensors
  (:func:`gather_for_checkpoint`), so rank 0 writes the same files as without FSDP (export and a
  resume without FSDP keep working); on resume every rank reads the whole tensors and keeps its
  shard (:func:`loading_whole_tensors`, :func:`shard_optimizer_state`);
- full fine-tuning with a KL reference: the reference is a whole, unsharded frozen copy.

FSDP1 (``fsdp_version: 1``), accelerate's own activation checkpointing, parameter offload and
trainers with two prepared models (PPO) are refused with a ConfigError. CPU processes are
switched to FSDP by :func:`grpo_ascend.distributed.compat_accelerate.switch_cpu_processes_to_fsdp`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.distributed import compat_fsdp2
from grpo_ascend.distributed.base import SaveState, StepPlan
from grpo_ascend.distributed.memory_layout import MemoryLayout, fsdp_layout
from grpo_ascend.distributed.plain import PlainStrategy
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.parameters import frozen_copy
from grpo_ascend.models.policy import hf_model

logger = logging.getLogger(__name__)


def check_fsdp(accelerator: Any, trainer_name: str, supported: bool) -> None:
    """Refuse the FSDP setups grpo-ascend cannot run correctly: FSDP1, accelerate's activation
    checkpointing, CPU offload, and trainers with more than one prepared model (PPO)."""
    plugin = accelerator.state.fsdp_plugin
    if int(plugin.fsdp_version) != 2:
        raise ConfigError(
            f"FSDP fsdp_version={plugin.fsdp_version} is not supported; set fsdp_version: 2 in the accelerate config "
            "(recipes/accelerate/fsdp2_1node_8cards.yaml). grpo-ascend gathers the sharded weights for rollouts "
            "with FSDP2's per-module unshard/reshard"
        )
    if not supported:
        raise ConfigError(
            f"{trainer_name} does not support FSDP: it trains two accelerate-prepared models (policy and critic), "
            "and accelerate's FSDP2 takes one model per prepare. Launch PPO with plain data parallelism "
            "(distributed_type MULTI_NPU / MULTI_GPU, or grpo-ascend train --num_processes N)"
        )
    if plugin.activation_checkpointing:
        raise ConfigError(
            "fsdp_activation_checkpointing is not supported: its layer wrappers recompute the decoder layers "
            "without knowing about the shared-prompt KV cache grpo-ascend fills in the log-prob forward. "
            "Set it to false and use gradient_checkpointing: true in the recipe instead"
        )
    if plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":
        raise ConfigError(
            "fsdp_offload_params is not supported (untested with the rollout's whole-weight gather and the "
            "checkpoint gather); set it to false"
        )
    # The log-prob wrapper returns views (a reshape of the chunked log-probs); FSDP2 warns because an
    # in-place op on them would skip its pre-backward hook. The losses only read them out of place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPCompletionLogprobs\) returned a view")
    if plugin.cpu_ram_efficient_loading:
        # Every rank loads the model itself before accelerate sees it; moving it to the meta device
        # and broadcasting rank 0's copy would only add a round trip.
        logger.info("FSDP: cpu_ram_efficient_loading has no effect here (each rank loads the model); turned off")
        plugin.cpu_ram_efficient_loading = False


def configure_plugin(accelerator: Any, model: nn.Module) -> None:
    """Before sharding: the sharding units and the mixed-precision policy.

    Units: accelerate reads ``_no_split_modules`` from the module it prepares, which here is the
    log-prob wrapper around the model, so ``transformer_cls_names_to_wrap`` is filled from the
    model's own (one unit per decoder layer) when the config names none.

    Mixed precision (bf16/fp16): accelerate's FSDP policy would cast the weights, the gradient
    reduction and the wrapper's output (float32 log-probs on purpose) to the low dtype. grpo-ascend
    instead does what it does without FSDP: weights stay in their loaded dtype (gathered as such),
    gradients are reduced in it, and the forward runs under autocast (:func:`autocast_forward`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    if plugin.mixed_precision_policy is not None:
        plugin.mixed_precision_policy = MixedPrecisionPolicy()  # no casts; autocast_forward does the compute
    policy = plugin.auto_wrap_policy
    if getattr(policy, "func", policy) is not transformer_auto_wrap_policy or plugin.transformer_cls_names_to_wrap:
        return

    names = list(getattr(hf_model(model), "_no_split_modules", None) or [])
    if names:
        plugin.transformer_cls_names_to_wrap = names
        logger.info("FSDP: sharding units %s (from the model's _no_split_modules)", ", ".join(names))


def autocast_forward(model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run ``model``'s forward under ``autocast()``, as accelerate does for a data-parallel model.

    accelerate leaves mixed precision under FSDP2 to its sharding policy (replaced by
    :func:`configure_plugin`), so the prepared wrapper's forward gets the autocast here.
    """
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with autocast():
            return original(*args, **kwargs)

    model.forward = forward




class FSDPStrategy(PlainStrategy):
    """FSDP2 sharding of the one prepared model; see the module docstring."""

    name = "fsdp"

    def validate(self, trainer_name: str, prepared_models: int) -> None:
        check_fsdp(self.accelerator, trainer_name, prepared_models == 1)

    def configure(self, policy: nn.Module, plan: StepPlan) -> None:
        configure_plugin(self.accelerator, policy)

    def unsharded_reference(self, policy: nn.Module, is_peft: bool, wants_reference: bool) -> nn.Module | None:
        if is_peft or not wants_reference:
            return None

        logger.warning("FSDP with full fine-tuning and beta > 0: the reference model is a whole, unsharded "
                       "copy on every rank")
        return frozen_copy(policy)

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                policy: nn.Module) -> tuple[nn.Module, Any]:
        model, optimizer = self.accelerator.prepare(model, optimizer)
        # FSDP2 all-gathers a decoder layer at each call: every rank must make the same calls.
        self.accelerator.unwrap_model(model).fixed_calls = True
        if self.precision != "fp32":
            autocast_forward(model, lambda: dev.autocast(self.device, self.precision))
        return model, optimizer

    @property
    def fixed_calls(self) -> bool:
        return True

    def memory_layout(self) -> MemoryLayout:
        return fsdp_layout(self.world_size)

    def may_merge_lora(self, wanted: bool | None, is_peft: bool) -> bool:
        if wanted is not False and is_peft:
            logger.info("rollouts keep LoRA unmerged under FSDP (merging into gathered weights is untested)")
        return False

    def whole_weights(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Every unit gathered once for generation and kept (no reshard after each layer's forward)."""
        return compat_fsdp2.units_stay_gathered(model)

    def stream_whole(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Each sharded parameter all-gathered alone (``DTensor.full_tensor``) as the consumer asks for it."""
        return stream_full_tensors(named)

    def grad_norm(self, params: list[nn.Parameter]) -> Tensor:
        max_norm = self.args.max_grad_norm
        if max_norm and max_norm > 0:  # sharded gradients: the norm comes back as a DTensor
            return full_value(self.accelerator.clip_grad_norm_(params, max_norm))
        return total_grad_norm(params)

    def save_state(self, module: nn.Module, optimizer: Any, output_dir: str | Path, step: int) -> SaveState:
        """Every rank takes part in the gather; the main rank keeps the whole tensors and writes them."""
        gathered = gather_for_checkpoint(module, optimizer.optimizer, self.accelerator.is_main_process)
        if gathered is None:
            return SaveState()
        return SaveState(optimizer=gathered.optimizer, trainable_weights=gathered.weights)

    def loading(self, module: nn.Module) -> contextlib.AbstractContextManager:
        return loading_whole_tensors()

    def after_load(self, path: Path, optimizer: Any) -> None:
        """Every rank read the whole Adam state: keep this rank's slices."""
        shard_optimizer_state(optimizer.optimizer)

    def export_source(self, policy: nn.Module, last_checkpoint: Path) -> nn.Module | Path:
        """The live weights are sharded: export the final checkpoint (saved just before)."""
        return last_checkpoint


def full_value(value: Any) -> Any:
    """A DTensor as the whole tensor (collective), anything else unchanged."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def stream_full_tensors(named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``named`` whole one at a time: a DTensor is all-gathered when asked for (every rank must iterate in the same
    order); the previous one is the caller's to drop."""
    for name, tensor in named:
        yield name, full_value(tensor.detach())


def total_grad_norm(params: list[nn.Parameter]) -> Tensor:
    """Global L2 norm of the (sharded) gradients of ``params``; every rank must call it."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return full_value(torch.nn.utils.get_total_norm(grads, 2.0)).float()


class _StateDict:
    """Hands an already gathered optimizer state dict to checkpoint.save_checkpoint."""

    def __init__(self, state: dict[str, Any]):
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


@dataclass
class Gathered:
    """Whole trainable weights (by parameter name) and optimizer state, on the CPU (main rank only)."""

    weights: dict[str, Tensor]
    optimizer: _StateDict


def gather_for_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, keep: bool) -> Gathered | None:
    """All-gather the trainable weights and Adam state to whole CPU tensors; every rank must call it.

    ``keep``: whether this rank keeps the result (the main rank, which writes the checkpoint);
    other ranks take part in the collectives and get None. The optimizer state dict keeps its
    usual layout (parameter indices, whole shapes), so it loads without FSDP too.
    """
    weights: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            whole = full_value(param.detach())
            if keep:
                weights[name] = whole.cpu().clone()
    source = optimizer.state_dict()
    state: dict[int, dict[str, Any]] = {}
    for index in sorted(source["state"]):
        entry = {}
        for key, value in source["state"][index].items():
            whole = full_value(value)
            entry[key] = whole.cpu().clone() if isinstance(whole, Tensor) else whole
        state[index] = entry
    if not keep:
        return None
    return Gathered(weights, _StateDict({"state": state, "param_groups": source["param_groups"]}))


@contextlib.contextmanager
def loading_whole_tensors() -> Iterator[None]:
    """Whole tensors copied into sharded parameters keep each rank's slice (DTensor implicit replication)."""
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        yield


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After loading a whole optimizer state, keep each rank's slice of every sharded parameter's state."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            entry = optimizer.state.get(param, {})
            for key, value in list(entry.items()):
                if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                    # Every rank read the same whole tensor: slice locally, no broadcast.
                    entry[key] = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                                                   src_data_rank=None)
