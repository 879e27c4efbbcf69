"""What a trainer saves and restores: the checkpoint contents, every rank's random streams, and
the trainer's own counters (the file format and its atomic writing are grpo_ascend/checkpoints/checkpoint.py's)."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev

logger = logging.getLogger(__name__)


class CheckpointingMixin:
    """Save and exact resume for :class:`~grpo_ascend.trainers.base.RLTrainerBase`."""

    def _restore_rank_random_state(self, extra: dict[str, Tensor], saved_world_size: int) -> None:
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
            self.generator.manual_seed(self.args.seed + 1000 * rank + 7919 * self.step)
        if saved_world_size != self.accelerator.num_processes and self.is_main_process:
            logger.warning(
                "the checkpoint was written by %d process(es) and is resumed by %d: training continues, but "
                "sampling does not replay the uninterrupted run exactly", saved_world_size, self.accelerator.num_processes
            )

    def _trainable_module(self) -> nn.Module:
        return self.policy

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

    def _save(self) -> None:
        from grpo_ascend.checkpoints import checkpoint as ckpt

        self.accelerator.wait_for_everyone()
        per_rank = self._per_rank_random_state()
        module = self._trainable_module()
        state = self.strategy.save_state(module, self.optimizer, self.args.output_dir, self.step)
        best = self._best_candidate()
        with self._gathered_trainable():  # every rank gathers (if partitioned), the main rank writes
            if self.is_main_process:
                contents = ckpt.CheckpointContents(
                    model=module,
                    trainer_state=self._trainer_state(),
                    optimizer=state.optimizer,
                    scheduler=self.scheduler,
                    scaler=self.accelerator.scaler,
                    config=self.args.to_dict(),
                    tokenizer=self.tokenizer,
                    extra_tensors={"sampling_generator": self.generator.get_state(), **per_rank,
                                   **self._extra_state_tensors()},
                    rng_device=self.device,
                    trainable_weights=state.trainable_weights,
                )
                ckpt.save_checkpoint(self.args.output_dir, self.step, contents, save_total_limit=self.args.save_total_limit,
                                     staging_dir=state.staging_dir, optimizer_shards=state.optimizer_shards,
                                     keep=best)
                self._write_best()
        self._last_saved_step = self.step
        self.accelerator.wait_for_everyone()
        self._push_checkpoint(Path(self.args.output_dir) / f"checkpoint-{self.step}")
        self._event("on_save")

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "round_index": self.round_index,
            "skipped_steps": self.skipped_steps,
            "sampler": self.sampler.state_dict(),
            "model_name": self.model_name,
            "world_size": self.accelerator.num_processes,
        }

    def _restore_trainer_state(self, state: dict[str, Any]) -> None:
        """Subclass hook: restore what the subclass added to :meth:`_trainer_state`."""

    def _extra_state_tensors(self) -> dict[str, Tensor]:
        """Subclass hook: tensors a resumed run needs besides the weights (main rank, inside the save)."""
        return {}

    def _restore_extra_state_tensors(self, extra: dict[str, Tensor]) -> None:
        """Subclass hook: take back what :meth:`_extra_state_tensors` saved."""

    def _load(self, path: Path) -> None:
        from grpo_ascend.checkpoints import checkpoint as ckpt

        module = self._trainable_module()
        with self.strategy.loading(module):  # every rank reads the whole tensors into its (sharded) weights
            loaded = ckpt.load_checkpoint(
                path,
                model=module,
                optimizer=self.strategy.optimizer_to_load(self.optimizer),
                scheduler=self.scheduler,
                scaler=self.accelerator.scaler,
                rng_device=self.device,
            )
        self.strategy.after_load(path, self.optimizer)
        state = loaded.trainer_state
        self.step = int(state["step"])
        self.round_index = int(state["round_index"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.sampler.load_state_dict(state["sampler"])
        self._restore_rank_random_state(loaded.extra_tensors, int(state.get("world_size", 1)))
        self._restore_trainer_state(state)
        self._restore_extra_state_tensors(loaded.extra_tensors)
        self._last_saved_step = self.step
        logger.info("resumed from %s at step %d", path, self.step)
