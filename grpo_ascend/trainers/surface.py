"""The events of Hugging Face's / TRL's trainer surface: ``trainer.state`` (a ``transformers.TrainerState``),
``callbacks=`` with ``TrainerCallback`` events, ``control.should_training_stop`` and ``state.log_history``
(saving and pushing the model are trainers/publishing.py's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo_ascend.config.configs import BaseRLConfig
from grpo_ascend.trainers.run_state import RunState


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


class EventHub:
    """``state``, ``control`` and the callbacks of one run; :meth:`fire` calls an event as transformers does.

    ``sampler`` gives ``state.epoch`` (passes over the prompts); ``objects`` are the keyword arguments
    every event receives (``model``, ``processing_class``, ``optimizer``, ``lr_scheduler``).
    """

    def __init__(self, *, args: BaseRLConfig, accelerator: Any, callbacks: Sequence[Any] | None,
                 run: RunState, sampler: Any, objects: dict[str, Any]):
        from transformers import TrainerControl, TrainerState

        self.args = args
        self.run = run
        self.sampler = sampler
        self.objects = objects
        self.state = TrainerState(max_steps=run.max_steps, logging_steps=args.logging_steps,
                                  save_steps=args.save_steps, train_batch_size=args.per_device_train_batch_size,
                                  num_train_epochs=args.num_train_epochs,
                                  is_local_process_zero=accelerator.is_local_main_process,
                                  is_world_process_zero=accelerator.is_main_process)
        self.control = TrainerControl()
        self.callbacks = CallbackList(callbacks or ())

    def fire(self, event: str, **kwargs: Any) -> None:
        """Call ``event`` on every callback with the run's step and epoch in ``state``."""
        self.state.global_step = self.run.step
        self.state.epoch = self.sampler.epochs_done
        self.control = self.callbacks.fire(event, self.args, self.state, self.control, **self.objects, **kwargs)

    def log(self, logs: dict[str, Any]) -> None:
        """One ``state.log_history`` entry and its ``on_log`` event (transformers' ``Trainer.log``)."""
        self.state.log_history.append({**logs, "step": self.run.step})
        self.fire("on_log", logs=logs)
