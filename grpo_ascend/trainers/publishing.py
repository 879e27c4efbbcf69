"""The trained model out of a run: ``trainer.save_model``, the end-of-run adapter export, and the Hub
(``trainer.push_to_hub`` / ``init_hf_repo`` / ``hub_model_id``, pushes after checkpoints per ``hub_strategy``)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from grpo_ascend.checkpoints import hub
from grpo_ascend.checkpoints.export import export_checkpoint
from grpo_ascend.config.configs import BaseRLConfig
from grpo_ascend.distributed.base import Strategy
from grpo_ascend.trainers.run_state import RunState


class ModelPublisher:
    """Writes and uploads the trained model; every rank calls each public method, the main rank writes.

    ``gathered``: context with the trainable parameters whole on every rank (sharded engines).
    """

    def __init__(self, *, args: BaseRLConfig, accelerator: Any, strategy: Strategy, run: RunState, policy: nn.Module,
                 tokenizer: Any, model_name: str, is_peft: bool,
                 gathered: Callable[[], contextlib.AbstractContextManager]):
        self.args = args
        self.accelerator = accelerator
        self.strategy = strategy
        self.run = run
        self.policy = policy
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.is_peft = is_peft
        self.gathered = gathered
        self.hub_model_id: str | None = None  # the repo's full id, once init_hf_repo has run
        if args.push_to_hub:  # as transformers: fail before training when the Hub can't be reached
            self.init_hf_repo()

    def _source(self) -> nn.Module | Path:
        """What an export reads: the live policy, or the checkpoint of the current step (the strategy's choice)."""
        return self.strategy.export_source(self.policy, Path(self.args.output_dir) / f"checkpoint-{self.run.step}")

    def export_adapter(self, destination: Path) -> str | None:
        """``export_adapter_at_end``: the adapter (or whole model) in PEFT's format; its folder on the main rank."""
        source, out = self._source(), None
        with self.gathered():  # every rank gathers (if partitioned), the main rank writes
            if self.accelerator.is_main_process:
                out = str(export_checkpoint(source, destination, tokenizer=self.tokenizer, base_model=self.model_name))
        return out

    def save_model(self, output_dir: str | os.PathLike | None = None, push: bool = True) -> None:
        """See :meth:`~grpo_ascend.trainers.base.RLTrainerBase.save_model`; ``push``: push after it per ``push_to_hub``."""
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        source = self._source()
        with self.gathered():  # every rank gathers (if partitioned), the main rank writes
            if self.accelerator.is_main_process:
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
        if self.args.push_to_hub and push:
            self.push_to_hub(commit_message="Model save")

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or find) the Hub repo ``hub_model_id`` (default: output_dir's name); sets ``hub_model_id``."""
        if not self.accelerator.is_main_process:
            return
        args = self.args
        self.hub_model_id = hub.create_repo(hub.repo_name(args.hub_model_id, args.output_dir),
                                            token=token if token is not None else args.hub_token,
                                            private=private if private is not None else args.hub_private_repo)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    model_name: str | None = None, dataset_name: str | None = None,
                    tags: str | list[str] | None = None) -> Any:
        """See :meth:`~grpo_ascend.trainers.base.RLTrainerBase.push_to_hub`."""
        args = self.args
        token = token if token is not None else args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(push=False)
        if not self.accelerator.is_main_process:
            return None
        assert self.hub_model_id is not None
        name = model_name or (args.hub_model_id.split("/")[-1] if args.hub_model_id else Path(args.output_dir).name)
        hub.write_model_card(Path(args.output_dir), self.model_name, self.is_peft, name, dataset_name, tags)
        return hub.upload(self.hub_model_id, args.output_dir, commit_message or "End of training", token,
                          revision if revision is not None else args.hub_revision, ignore=hub.IGNORE_PATTERNS,
                          blocking=blocking)

    def push_checkpoint(self, checkpoint: Path) -> None:
        """After a checkpoint save, per ``hub_strategy``: the model in output_dir, and the checkpoint folder."""
        args = self.args
        if not args.push_to_hub or args.hub_strategy == "end":
            return
        self.save_model(push=False)
        if not self.accelerator.is_main_process:
            return
        if self.hub_model_id is None:
            self.init_hf_repo()
        assert self.hub_model_id is not None
        message = f"Training in progress, step {self.run.step}"
        hub.upload(self.hub_model_id, args.output_dir, message, args.hub_token, args.hub_revision,
                   ignore=hub.IGNORE_PATTERNS)
        if args.hub_strategy in ("checkpoint", "all_checkpoints"):
            where = "last-checkpoint" if args.hub_strategy == "checkpoint" else checkpoint.name
            hub.upload(self.hub_model_id, checkpoint, message + ", checkpoint", args.hub_token, args.hub_revision,
                       path_in_repo=where)
