"""What users call on a trainer besides ``train()``: ``evaluate()`` and transformers' / TRL's trainer surface
(``model``, ``state``, ``control``, callbacks, ``save_model``, the Hub, ``end``), each handed to the part that
owns it (trainers/base.py builds the parts)."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from grpo_ascend.tracking.run_tracker import RunTracker


class TrainerPublicAPI:
    """A mixin of :class:`~grpo_ascend.trainers.base.RLTrainerBase`: the public methods over its parts
    (``evaluator``, ``recorder``, ``events``, ``best``, ``publisher``, ``policy``, ``tokenizer`` ...)."""

    evaluator: Any
    recorder: Any
    events: Any
    best: Any
    publisher: Any
    policy: nn.Module
    tokenizer: Any
    scheduler: Any
    accelerator: Any
    run: Any
    micro_batcher: Any

    @property
    def step(self) -> int:
        """Optimizer steps taken (transformers' ``global_step``)."""
        return self.run.step

    @property
    def max_steps(self) -> int:
        """Optimizer steps the run takes in all."""
        return self.run.max_steps

    @max_steps.setter
    def max_steps(self, value: int) -> None:
        self.run.max_steps = value

    @property
    def round_index(self) -> int:
        return self.run.round_index

    @property
    def skipped_steps(self) -> int:
        return self.run.skipped_steps

    @property
    def tracker(self) -> RunTracker | None:
        """metrics.jsonl and the trackers of the open (or last) run; None before ``train()``."""
        return self.recorder.tracker

    @property
    def token_budget(self) -> int | None:
        """The training micro-batches' token budget: ``max_tokens_per_micro_batch``, 'auto' as resolved at start-up."""
        return self.micro_batcher.token_budget

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate the current policy on ``eval_dataset`` (default: the trainer's); every rank must call.

        Returns the metrics with ``metric_key_prefix/`` names, logs them (metrics.jsonl and the
        trackers while a run is open, ``state.log_history`` always) and fires ``on_evaluate``.
        Several eval sets (a dict or ``DatasetDict``; a name picks one of the trainer's) are
        evaluated one by one as in transformers, each under the prefix ``<metric_key_prefix>_<name>``
        (``eval_<name>/reward``), each logged on its own; the returned dict holds them all.
        """
        metrics: dict[str, float] = {}
        for record in self.evaluator.evaluate(eval_dataset, metric_key_prefix):
            self.recorder.evaluation(record)
            self.events.fire("on_evaluate", metrics=record)
            metrics.update(record)
        return metrics

    def _evaluate_in_run(self) -> None:
        self.best.note_evaluation(self.evaluate())

    # ------------------------------------------------------------------------------ TRL's trainer surface
    @property
    def model(self) -> nn.Module:
        """The model being trained: the PEFT-wrapped policy with LoRA, else the policy itself."""
        return self.policy

    @property
    def processing_class(self) -> Any:
        """The tokenizer, or a vision-language model's processor (TRL's ``processing_class``)."""
        return self.processor if self.processor is not None else self.tokenizer

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate schedule (transformers' name)."""
        return self.scheduler

    @property
    def state(self) -> Any:
        """transformers' ``TrainerState`` of the run (``global_step``, ``epoch``, ``log_history``, ...)."""
        return self.events.state

    @property
    def control(self) -> Any:
        """transformers' ``TrainerControl``: a callback sets ``should_training_stop`` to end the run."""
        return self.events.control

    @property
    def callbacks(self) -> Any:
        return self.events.callbacks

    def add_callback(self, callback: Any) -> None:
        """Add a ``TrainerCallback`` (instance or class)."""
        self.events.callbacks.add(callback)

    @property
    def hub_model_id(self) -> str | None:
        """The Hub repo's full id, once :meth:`init_hf_repo` has run."""
        return self.publisher.hub_model_id

    def save_model(self, output_dir: str | os.PathLike | None = None, _internal_call: bool = False) -> None:
        """Write the trained model into ``output_dir`` (default: the run's): the LoRA adapter in PEFT's
        format, or the whole model for full fine-tuning, plus the tokenizer. Files already in the
        folder (metrics, checkpoints) are kept; same-named files are replaced. Every rank must call it.
        With ``push_to_hub`` the run's output_dir is then pushed (as transformers)."""
        self.publisher.save_model(output_dir, push=not _internal_call)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or find) the Hub repo ``hub_model_id`` (default: output_dir's name)."""
        self.publisher.init_hf_repo(token, private)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    model_name: str | None = None, dataset_name: str | None = None,
                    tags: str | list[str] | None = None) -> Any:
        """Save the model into output_dir, write a model card (README.md) and upload output_dir (without
        its checkpoint-* folders) to ``hub_model_id``. Every rank must call it; the main rank uploads and
        gets the CommitInfo (a Future when not ``blocking``). Raises :class:`~grpo_ascend.checkpoints.hub.HubError`
        with what to do when the Hub can't be reached (offline, no token, no write access)."""
        return self.publisher.push_to_hub(commit_message, blocking, token, revision, private, model_name,
                                          dataset_name, tags)

    def end(self) -> None:
        """Finish the trackers and destroy the process group (TRL / transformers ``Trainer.end``): call it once,
        last; train, evaluate, save_model and push_to_hub need the other processes and fail after it."""
        if self.tracker is not None:
            self.tracker.abort()  # closes any tracker still open (train closes its own at the end)
        self.accelerator.end_training()

