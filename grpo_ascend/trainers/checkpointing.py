"""What a trainer saves and restores: the checkpoint contents, every rank's random streams, and
the run's counters (the file format and its atomic writing are grpo_ascend/checkpoints/checkpoint.py's)."""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.checkpoints import checkpoint as ckpt
from grpo_ascend.config.configs import BaseRLConfig
from grpo_ascend.data.prompts import PromptSampler, StreamSampler
from grpo_ascend.distributed.base import Strategy
from grpo_ascend.models.parameters import trainable_parameters
from grpo_ascend.trainers.best_tracking import BestCheckpointTracker
from grpo_ascend.trainers.run_state import RunState

logger = logging.getLogger(__name__)


@dataclass
class Resumed:
    """What a resume hands back to the trainer: its own saved state and tensors (the counters,
    sampler and random streams are already restored)."""

    trainer_state: dict[str, Any]
    extra_tensors: dict[str, Tensor]


class Checkpointer:
    """Save and exact resume of one run; every rank calls :meth:`save` and :meth:`load` together.

    ``module`` is what a checkpoint holds (the policy, with PPO's critic), ``generator`` the
    sampling generator (seeded per rank), ``best`` decides which checkpoint ``save_total_limit``
    keeps and writes the ``best`` pointer.
    """

    def __init__(self, *, args: BaseRLConfig, accelerator: Any, strategy: Strategy, run: RunState, module: nn.Module,
                 optimizer: Any, scheduler: Any, sampler: PromptSampler | StreamSampler, generator: torch.Generator, tokenizer: Any,
                 model_name: str, best: BestCheckpointTracker):
        self.args = args
        self.accelerator = accelerator
        self.strategy = strategy
        self.run = run
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.generator = generator
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.best = best
        self.device = accelerator.device

    def gathered(self, modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
        """The checkpointed trainable parameters whole on every rank inside the block (all ranks enter)."""
        return self.strategy.gathered(trainable_parameters(self.module), modifier_rank=modifier_rank)

    def save(self, trainer_state: dict[str, Any], extra_tensors: dict[str, Tensor]) -> Path:
        """Write ``checkpoint-<step>`` with the trainer's own ``trainer_state`` and ``extra_tensors``; its path."""
        args, run = self.args, self.run
        self.accelerator.wait_for_everyone()
        per_rank = self._per_rank_random_state()
        state = self.strategy.save_state(self.module, self.optimizer, args.output_dir, run.step)
        keep = self.best.candidate()
        with self.gathered():  # every rank gathers (if partitioned), the main rank writes
            if self.accelerator.is_main_process:
                contents = ckpt.CheckpointContents(
                    model=self.module,
                    trainer_state={**run.counters(), "sampler": self.sampler.state_dict(),
                                   "model_name": self.model_name, "world_size": self.accelerator.num_processes,
                                   **trainer_state},
                    optimizer=state.optimizer,
                    scheduler=self.scheduler,
                    scaler=self.accelerator.scaler,
                    config=args.to_dict(),
                    tokenizer=self.tokenizer,
                    extra_tensors={"sampling_generator": self.generator.get_state(), **per_rank, **extra_tensors},
                    rng_device=self.device,
                    trainable_weights=state.trainable_weights,
                )
                ckpt.save_checkpoint(args.output_dir, run.step, contents, save_total_limit=args.save_total_limit,
                                     staging_dir=state.staging_dir, optimizer_shards=state.optimizer_shards, keep=keep)
                self.best.write_pointer()
        run.last_saved_step = run.step
        self.accelerator.wait_for_everyone()
        return Path(args.output_dir) / f"checkpoint-{run.step}"

    def load(self, path: Path) -> Resumed:
        """Resume from ``path``: weights, optimizer, schedule, counters, sampler and this rank's random streams."""
        with self.strategy.loading(self.module):  # every rank reads the whole tensors into its (sharded) weights
            loaded = ckpt.load_checkpoint(
                path,
                model=self.module,
                optimizer=self.strategy.optimizer_to_load(self.optimizer),
                scheduler=self.scheduler,
                scaler=self.accelerator.scaler,
                rng_device=self.device,
            )
        self.strategy.after_load(path, self.optimizer)
        state = loaded.trainer_state
        self.run.restore_counters(state)
        self.sampler.load_state_dict(state["sampler"])
        self.restore_rank_random_state(loaded.extra_tensors, int(state.get("world_size", 1)))
        logger.info("resumed from %s at step %d", path, self.run.step)
        return Resumed(state, loaded.extra_tensors)

    def load_weights(self, path: Path) -> None:
        """Only the weights of the checkpoint at ``path`` into the model (every rank; ``load_best_model_at_end``)."""
        self.accelerator.wait_for_everyone()
        with self.strategy.loading(self.module):
            ckpt.load_checkpoint(path, model=self.module, restore_rng=False)

    def restore_rank_random_state(self, extra: dict[str, Tensor], saved_world_size: int) -> None:
        """Give this rank its own saved RNG and sampling-generator states (load_checkpoint restored rank 0's)."""
        rank = self.accelerator.process_index
        rng_bytes = extra.get(f"rank{rank}/rng_state")
        gen_state = extra.get(f"rank{rank}/sampling_generator")
        if gen_state is None and rank == 0:
            gen_state = extra.get("sampling_generator")
        if rng_bytes is not None:
            state = torch.load(io.BytesIO(rng_bytes.numpy().tobytes()), map_location="cpu", weights_only=True)
            dev.set_rng_state(state, self.device)
        if gen_state is not None:
            self.generator.set_state(gen_state)
        else:  # this rank did not exist in the saved run: a fresh stream, distinct per rank and step
            self.generator.manual_seed(self.args.seed + 1000 * rank + 7919 * self.run.step)
        if saved_world_size != self.accelerator.num_processes and self.accelerator.is_main_process:
            logger.warning(
                "the checkpoint was written by %d process(es) and is resumed by %d: training continues, but "
                "sampling does not replay the uninterrupted run exactly", saved_world_size, self.accelerator.num_processes
            )

    def _per_rank_random_state(self) -> dict[str, Tensor]:
        """Every rank's RNG and sampling-generator states, gathered to all ranks (several processes only).

        Each rank draws from its own streams (the sampling generator is seeded per rank), so an exact
        resume restores each rank's own. RNG states are stored as ``torch.save`` bytes and read back
        with ``weights_only=True``.
        """
        if self.accelerator.num_processes == 1:
            return {}
        from accelerate.utils import gather_object

        buffer = io.BytesIO()
        torch.save(dev.rng_state(self.device), buffer)
        mine = (buffer.getvalue(), self.generator.get_state().cpu())
        out: dict[str, Tensor] = {}
        for rank, (rng_bytes, gen_state) in enumerate(gather_object([mine])):
            out[f"rank{rank}/rng_state"] = torch.frombuffer(bytearray(rng_bytes), dtype=torch.uint8)
            out[f"rank{rank}/sampling_generator"] = gen_state
        return out
