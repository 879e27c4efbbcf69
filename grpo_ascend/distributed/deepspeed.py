"""DeepSpeed ZeRO-1/2/3 behind accelerate (``distributed_type: DEEPSPEED``) for the GRPO trainer.

grpo-ascend normalises each optimizer step's loss itself, marks the engine's accumulation
boundary per micro-batch and calls the engine's backward without its accumulation scaling; the
engine clips (``gradient_clipping`` = ``max_grad_norm``) and skips a step whose global gradient
norm is NaN/inf. ZeRO-1/2 shard the optimizer state: every rank writes its own shard into the
main rank's staging folder at a save and reads it back at a resume.

ZeRO-3 also partitions every parameter (``param.data`` is empty on each rank; DeepSpeed's module
hooks all-gather a module's weights for its forward and backward). The training forward runs
under those hooks unchanged; three places need whole weights outside them:

- rollouts: the whole policy is gathered once per round with the hooks removed
  (DeepSpeed's ``unwrap_model_for_generation``) instead of at every decoding step;
- checkpoint save: every rank takes part in gathering the trainable parameters, the main rank
  writes the same files as without DeepSpeed;
- resume: the trainable parameters are gathered, every rank reads the same files into them and
  rank 0's values are partitioned back; the fp32 master partitions come with the optimizer shard.

Refused: ZeRO-0, trainers with two prepared models (PPO), full fine-tuning under ZeRO-3.
Every DeepSpeed internal used is in :mod:`grpo_ascend.distributed.compat_deepspeed`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend.checkpoints import optimizer_shards
from grpo_ascend.distributed import compat_deepspeed as compat
from grpo_ascend.distributed.base import SaveState, StepPlan, StrategyArgs
from grpo_ascend.distributed.memory_layout import MemoryLayout, deepspeed_layout
from grpo_ascend.distributed.plain import PlainStrategy
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.parameters import trainable_parameters
from grpo_ascend.models.policy import backbone_and_head

logger = logging.getLogger(__name__)


def zero_stage(accelerator: Any) -> int:
    """The ZeRO stage accelerate runs DeepSpeed with, 0 without DeepSpeed."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else 0


def fill_config(ds: dict[str, Any], args: StrategyArgs, plan: StepPlan, world_size: int) -> None:
    """Fill the DeepSpeed config ``ds`` from this run's config: micro-batch, accumulation and clipping.

    The engine's own accumulation scaling is bypassed (see the module docstring), so these values
    only have to be consistent; values set in the accelerate/DeepSpeed config that disagree with
    the run's are overridden with a warning. An optimizer or scheduler section is refused.
    """
    wanted: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "train_batch_size": args.per_device_train_batch_size * plan.grad_accum * world_size,
        "gradient_clipping": float(args.max_grad_norm or 0.0),
    }
    for key, value in wanted.items():
        have = ds.get(key, "auto")
        if have not in ("auto", None) and have != value:
            logger.warning("DeepSpeed config %s=%r replaced by %r from the grpo-ascend config", key, have, value)
        ds[key] = value
    if "optimizer" in ds or "scheduler" in ds:
        raise ConfigError(
            "the DeepSpeed config defines an 'optimizer' or 'scheduler'; grpo-ascend builds its own AdamW and "
            "LR schedule from the run config (learning_rate, lr_scheduler_type, ...): remove them"
        )


class DeepSpeedStrategy(PlainStrategy):
    """The DeepSpeed engine drives backward and step; ZeRO-3 adds the gathers described above."""

    name = "deepspeed"

    def validate(self, trainer_name: str, prepared_models: int) -> None:
        self.stage = zero_stage(self.accelerator)
        if self.stage not in (1, 2, 3):
            raise ConfigError(
                f"DeepSpeed zero_stage={self.stage} is not supported; use zero_stage 2 "
                "(recipes/accelerate/deepspeed_zero2.yaml), 3 (deepspeed_zero3.yaml) or plain data parallelism: "
                "ZeRO-0 adds nothing over plain data parallelism"
            )
        if prepared_models > 1:
            raise ConfigError(
                f"{trainer_name} does not support DeepSpeed: it trains two accelerate-prepared models "
                "(policy and critic), and accelerate gives DeepSpeed one engine per model. Launch PPO with plain "
                "data parallelism (distributed_type MULTI_NPU / MULTI_GPU, or grpo-ascend train --num_processes N)"
            )

    @property
    def partitions_parameters(self) -> bool:
        """ZeRO-3: every parameter is partitioned over the ranks."""
        return self.stage == 3

    @property
    def fixed_calls(self) -> bool:
        return self.partitions_parameters

    def parameter_numel(self, param: nn.Parameter) -> int:
        return compat.full_numel(param)

    def validate_model(self, is_peft: bool) -> None:
        """Refuse full fine-tuning under ZeRO-3: its reference policy is a frozen copy of the weights."""
        if self.partitions_parameters and not is_peft:
            raise ConfigError(
                "full fine-tuning (no peft_config) is not supported under DeepSpeed ZeRO-3: the reference policy "
                "would be a deep copy of partitioned weights, and whole-model checkpoints are not gathered. Train a "
                "LoRA adapter (peft_config / the recipe's lora section) under ZeRO-3, or fully fine-tune under "
                "ZeRO-2 (recipes/accelerate/deepspeed_zero2.yaml)"
            )

    def configure(self, policy: nn.Module, plan: StepPlan) -> None:
        fill_config(self.accelerator.state.deepspeed_plugin.deepspeed_config, self.args, plan, self.world_size)
        self.accelerator.gradient_accumulation_steps = plan.grad_accum  # accelerate warns when it disagrees

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                policy: nn.Module) -> tuple[nn.Module, Any]:
        engine, optimizer = self.accelerator.prepare(model, optimizer)
        if self.partitions_parameters:
            self._same_gathers_on_every_rank(engine, policy)
        return engine, optimizer

    def _same_gathers_on_every_rank(self, engine: nn.Module, policy: nn.Module) -> None:
        """Make every rank issue the same ZeRO-3 gathers in the log-prob forward, whatever its batch holds.

        The decoder runs the same calls with or without repeated prompts (``fixed_calls``). The
        output head runs once per token chunk (and again in the backward's recompute), and the
        chunk count follows this rank's completion lengths: its parameters are registered as
        external parameters of the root, gathered once when its forward starts and kept whole
        until the optimizer step re-partitions everything.
        """

        module = self.accelerator.unwrap_model(engine)
        module.fixed_calls = True
        _, head = backbone_and_head(policy)
        for param in head.parameters():
            if compat.is_partitioned(param):
                compat.register_external(module, param)

    def memory_layout(self) -> MemoryLayout:
        return deepspeed_layout(self.stage, self.world_size)

    def may_merge_lora(self, wanted: bool | None, is_peft: bool) -> bool:
        if not self.partitions_parameters:
            return True
        if wanted:
            logger.warning("rollout_merge_lora is off under DeepSpeed ZeRO-3: the merge swaps the base weights' "
                           "storage, which ZeRO-3 owns; generating with the adapters unmerged")
        else:
            logger.info("DeepSpeed ZeRO-3: rollouts run with the adapters unmerged")
        return False

    def may_fuse_lora(self) -> bool:
        return not self.partitions_parameters  # ZeRO-3 gathers lora_A/lora_B/base_layer in their own hooks

    def whole_weights(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if not self.partitions_parameters:
            return contextlib.nullcontext()
        return compat.unwrapped_for_generation(model)

    def full_shape(self, tensor: Tensor) -> tuple[int, ...]:
        return compat.full_shape(tensor)

    def stream_whole(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """ZeRO-3: each partitioned parameter gathered alone while the consumer reads it, partitioned again
        when the next one is asked for (``named`` must hold the live parameters: ``state_dict(keep_vars=True)``)."""
        for name, tensor in named:
            with compat.gathered([tensor]):
                yield name, tensor.detach()

    def no_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """The engine decides when to reduce: mark whether this micro-batch ends the accumulation."""
        compat.set_accumulation_boundary(model, last)
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: Tensor) -> None:
        compat.backward_unscaled(model, loss)

    def clip_and_step(self, model: nn.Module, optimizer: Any, params: list[nn.Parameter],
                      loss_finite: Tensor) -> tuple[float, bool]:
        """The engine's step: it clips and skips the step on a NaN/inf global norm (ZeRO-1/2 check it in
        every precision), then zeroes the gradients."""
        norm, applied = compat.step_checking_overflow(model)
        return (float(norm) if norm is not None else float("nan")), applied

    def gathered(self, params: list[nn.Parameter], modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
        return compat.gathered(params, modifier_rank=modifier_rank)

    def save_state(self, module: nn.Module, optimizer: Any, output_dir: str | Path, step: int) -> SaveState:
        """Every rank writes its optimizer shard into the main rank's staging folder; the main rank then
        completes the checkpoint (manifest over all shards) and renames it."""
        from accelerate.utils import broadcast_object_list


        made = [str(optimizer_shards.make_staging_dir(output_dir, step)) if self.accelerator.is_main_process else None]
        staging = broadcast_object_list(made, from_process=0)[0]
        optimizer_shards.write_optimizer_shard(staging, self.accelerator.process_index, compat.plain_optimizer_state(optimizer.optimizer))
        self.accelerator.wait_for_everyone()
        return SaveState(optimizer=None, staging_dir=staging, optimizer_shards=self.world_size)

    def loading(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """ZeRO-3: every rank reads the same files into the gathered parameters; rank 0's values are kept."""

        return self.gathered(trainable_parameters(module), modifier_rank=0)

    def optimizer_to_load(self, optimizer: Any) -> Any:
        return None  # each rank reads its own shard in after_load

    def after_load(self, path: Path, optimizer: Any) -> None:
        """Restore this rank's ZeRO optimizer shard: Adam state and fp32 master partition, loss scale."""

        state = optimizer_shards.load_optimizer_shard(path, self.accelerator.process_index, self.world_size)
        compat.load_plain_optimizer_state(optimizer.optimizer, state, self.world_size)
