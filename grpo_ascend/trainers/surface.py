"""The parts of Hugging Face's / TRL's trainer surface that scripts written for TRL touch:
``trainer.model``, ``trainer.state`` (a ``transformers.TrainerState``), ``callbacks=`` with
``TrainerCallback`` events and ``control.should_training_stop``, ``trainer.save_model``,
``trainer.push_to_hub`` / ``trainer.hub_model_id`` and ``trainer.end``."""

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
        self.hub_model_id: str | None = None  # the repo's full id, once init_hf_repo has run
        if args.push_to_hub:  # as transformers: fail before training when the Hub can't be reached
            self.init_hf_repo()

    @property
    def model(self) -> nn.Module:
        """The model being trained: the PEFT-wrapped policy with LoRA, else the policy itself."""
        return self.policy

    @property
    def processing_class(self) -> Any:
        return self.tokenizer

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate schedule (transformers' name)."""
        return self.scheduler

    def add_callback(self, callback: Any) -> None:
        """Add a ``TrainerCallback`` (instance or class)."""
        self.callbacks.add(callback)

    def _event(self, event: str, **kwargs: Any) -> None:
        self.state.global_step = self.step
        self.state.epoch = self.sampler.epochs_done
        self.control = self.callbacks.fire(event, self.args, self.state, self.control, model=self.policy,
                                           processing_class=self.tokenizer, optimizer=self.optimizer,
                                           lr_scheduler=self.scheduler, **kwargs)

    def save_model(self, output_dir: str | os.PathLike | None = None, _internal_call: bool = False) -> None:
        """Write the trained model into ``output_dir`` (default: the run's): the LoRA adapter in PEFT's
        format, or the whole model for full fine-tuning, plus the tokenizer. Files already in the
        folder (metrics, checkpoints) are kept; same-named files are replaced. Every rank must call it.
        With ``push_to_hub`` the run's output_dir is then pushed (as transformers)."""
        from grpo_ascend.checkpoints.export import export_checkpoint

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
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    # ------------------------------------------------------------------------------ Hub
    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or find) the Hub repo ``hub_model_id`` (default: output_dir's name); sets ``self.hub_model_id``."""
        from grpo_ascend.checkpoints import hub

        if not self.is_main_process:
            return
        args = self.args
        self.hub_model_id = hub.create_repo(hub.repo_name(args.hub_model_id, args.output_dir),
                                            token=token if token is not None else args.hub_token,
                                            private=private if private is not None else args.hub_private_repo)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    model_name: str | None = None, dataset_name: str | None = None,
                    tags: str | list[str] | None = None) -> Any:
        """Save the model into output_dir, write a model card (README.md) and upload output_dir (without
        its checkpoint-* folders) to ``hub_model_id``. Every rank must call it; the main rank uploads and
        gets the CommitInfo (a Future when not ``blocking``). Raises :class:`~grpo_ascend.checkpoints.hub.HubError`
        with what to do when the Hub can't be reached (offline, no token, no write access)."""
        from grpo_ascend.checkpoints import hub

        args = self.args
        token = token if token is not None else args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_main_process:
            return None
        assert self.hub_model_id is not None
        name = model_name or (args.hub_model_id.split("/")[-1] if args.hub_model_id else Path(args.output_dir).name)
        hub.write_model_card(Path(args.output_dir), self.model_name, self.is_peft, name, dataset_name, tags)
        return hub.upload(self.hub_model_id, args.output_dir, commit_message or "End of training", token,
                          revision if revision is not None else args.hub_revision, ignore=hub.IGNORE_PATTERNS,
                          blocking=blocking)

    def _push_checkpoint(self, checkpoint: Path) -> None:
        """After a checkpoint save, per ``hub_strategy``: the model in output_dir, and the checkpoint folder."""
        from grpo_ascend.checkpoints import hub

        args = self.args
        if not args.push_to_hub or args.hub_strategy == "end":
            return
        self.save_model(_internal_call=True)
        if not self.is_main_process:
            return
        if self.hub_model_id is None:
            self.init_hf_repo()
        assert self.hub_model_id is not None
        message = f"Training in progress, step {self.step}"
        hub.upload(self.hub_model_id, args.output_dir, message, args.hub_token, args.hub_revision,
                   ignore=hub.IGNORE_PATTERNS)
        if args.hub_strategy in ("checkpoint", "all_checkpoints"):
            where = "last-checkpoint" if args.hub_strategy == "checkpoint" else checkpoint.name
            hub.upload(self.hub_model_id, checkpoint, message + ", checkpoint", args.hub_token, args.hub_revision,
                       path_in_repo=where)

    def end(self) -> None:
        """Finish the trackers and destroy the process group (TRL / transformers ``Trainer.end``): call it once,
        last; train, evaluate, save_model and push_to_hub need the other processes and fail after it."""
        if self.tracker is not None:
            self.tracker.abort()  # closes any tracker still open (train closes its own at the end)
        self.accelerator.end_training()
