"""A trainer's checkpoints as its users and subclasses see them: save and load (the algorithm's own state and
the rollout ledger included through hooks), and the best checkpoint's weights; the writing itself is the
Checkpointer's (trainers/checkpointing.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import Tensor

logger = logging.getLogger(__name__)


class TrainerCheckpoints:
    """A mixin of :class:`~grpo_ascend.trainers.base.RLTrainerBase` over its ``checkpointer``, ``publisher``,
    ``events``, ``experience``, ``ranks``, ``best`` and ``run``."""

    checkpointer: Any
    publisher: Any
    events: Any
    experience: Any
    ranks: Any
    best: Any
    run: Any

    def save_checkpoint(self) -> Path:
        """Save a checkpoint of this step into ``output_dir/checkpoint-<step>`` (every rank must call): the
        trainable weights, optimizer, schedule, every rank's RNGs, the counters and the algorithm's own state;
        pushed per ``hub_strategy``; fires ``on_save``. ``train()`` saves every ``save_steps`` and at the end.
        Returns the checkpoint's folder."""
        path = self.checkpointer.save({**self._trainer_state(), **self._rollout_ledger()}, self._extra_state_tensors())
        self.publisher.push_checkpoint(path)
        self.events.fire("on_save")
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore the trainer from the checkpoint at ``path`` (every rank must call): weights, optimizer, schedule,
        RNGs, counters and the algorithm's own state, as a resume does (which also takes the run's best
        checkpoint back from ``best.json``)."""
        resumed = self.checkpointer.load(Path(path))
        ledgers = resumed.trainer_state.get("rollout_ledger")
        if ledgers is not None:
            self.experience.source.load_state_dict(ledgers[self.ranks.rank])
        self._restore_trainer_state(resumed.trainer_state)
        self._restore_extra_state_tensors(resumed.extra_tensors)

    def _rollout_ledger(self) -> dict[str, Any]:
        """Every rank's experience-source state (prompts in flight ahead of training), when its source has one."""
        state = self.experience.source.state_dict()
        if state is None:
            return {}
        from accelerate.utils import gather_object

        return {"rollout_ledger": [state] if self.ranks.world == 1 else gather_object([state])}

    def _trainer_state(self) -> dict[str, Any]:
        """Subclass hook: the algorithm's own state a checkpoint's trainer_state.json adds (JSON)."""
        return {}

    def _restore_trainer_state(self, state: dict[str, Any]) -> None:
        """Subclass hook: restore what the subclass added to :meth:`_trainer_state`."""

    def _extra_state_tensors(self) -> dict[str, Tensor]:
        """Subclass hook: tensors a resumed run needs besides the weights."""
        return {}

    def _restore_extra_state_tensors(self, extra: dict[str, Tensor]) -> None:
        """Subclass hook: take back what :meth:`_extra_state_tensors` saved."""

    def load_best_model(self) -> bool:
        """The best checkpoint's weights (``metric_for_best_model``) into the model (every rank must call); False
        when there is no best checkpoint yet. ``train()`` ends with it under ``load_best_model_at_end``."""
        path = self.best.path()
        if path is None:
            return False
        self.checkpointer.load_weights(path)
        assert self.run.best is not None
        logger.info("loaded the best checkpoint %s (%s = %g)", path, self.run.best.metric, self.run.best.value)
        return True
