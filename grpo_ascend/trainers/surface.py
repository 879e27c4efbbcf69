"""The parts of Hugging Face's / TRL's trainer surface that scripts written for TRL touch:
``trainer.model``, ``trainer.state`` (a ``transformers.TrainerState``), ``callbacks=`` with
``TrainerCallback`` events and ``control.should_training_stop``, and ``trainer.save_model``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn


class CallbackList:
    """Calls ``TrainerCallback`` events as transformers' Trainer does: ``(args, state, control, **kwargs)``;
    a callback may return a new ``TrainerControl``."""

    def __init__(self, callbacks: Sequence[Any] = ()) -> None:
        self.callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks]

    def add(self, callback: Any) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def fire(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        for callback in self.callbacks:
            result = getattr(callback, event, lambda *a, **k: None)(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control


class TrainerSurfaceMixin:
    """TRL-compatible attributes and events for :class:`~grpo_ascend.trainers.base.RLTrainerBase`."""

    def _init_surface(self, callbacks: Sequence[Any] | None) -> None:
        from transformers import TrainerControl, TrainerState

        args = self.args
        self.state = TrainerState(max_steps=self.max_steps, logging_steps=args.logging_steps,
                                  save_steps=args.save_steps, train_batch_size=args.per_device_train_batch_size,
                                  num_train_epochs=args.num_train_epochs,
                                  is_local_process_zero=self.accelerator.is_local_main_process,
                                  is_world_process_zero=self.accelerator.is_main_process)
        self.control = TrainerControl()
        self.callbacks = CallbackList(callbacks or ())

    @property
    def model(self) -> nn.Module:
        """The model being trained: the PEFT-wrapped policy with LoRA, else the policy itself."""
        return self.policy

    @property
    def processing_class(self) -> Any:
        return self.tokenizer

    def add_callback(self, callback: Any) -> None:
        """Add a ``TrainerCallback`` (instance or class)."""
        self.callbacks.add(callback)

    def _event(self, event: str, **kwargs: Any) -> None:
        self.state.global_step = self.step
        self.state.epoch = self.sampler.epochs_done
        self.control = self.callbacks.fire(event, self.args, self.state, self.control, model=self.policy,
                                           processing_class=self.tokenizer, optimizer=self.optimizer,
                                           lr_scheduler=self.scheduler, **kwargs)

    def save_model(self, output_dir: str | os.PathLike | None = None) -> None:
        """Write the trained model into ``output_dir`` (default: the run's): the LoRA adapter in PEFT's
        format, or the whole model for full fine-tuning, plus the tokenizer. Files already in the
        folder (metrics, checkpoints) are kept; same-named files are replaced. Every rank must call it."""
        from grpo_ascend.export import export_checkpoint

        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        source = self.strategy.export_source(self.policy, Path(self.args.output_dir) / f"checkpoint-{self.step}")
        with self._gathered_trainable():  # every rank gathers (if partitioned), the main rank writes
            if self.is_main_process:
                out.mkdir(parents=True, exist_ok=True)
                staged = export_checkpoint(source, out / ".save_model-tmp", tokenizer=self.tokenizer,
                                           base_model=self.model_name)
                for item in staged.iterdir():
                    target = out / item.name
                    if target.is_dir() and not target.is_symlink():
                        shutil.rmtree(target)
                    os.replace(item, target)
                staged.rmdir()
        self.accelerator.wait_for_everyone()
