"""The state of one run that the trainer's parts share, declared in one place.

The trainer holds one :class:`RunState` and hands it to the parts that read or move it: the
checkpointer (saves and restores the counters), the best-checkpoint tracker (evaluation results
and the best so far), the event hub (``state.global_step``). Everything else a part keeps is its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BestCheckpoint:
    """The saved checkpoint that scored best on ``metric`` (``metric_for_best_model``)."""

    step: int
    value: float
    metric: str


@dataclass
class RunState:
    """Counters and records of a run; a checkpoint saves the counters, a resume restores them."""

    #: Optimizer steps the run takes in all (``max_steps``, or the steps of ``num_train_epochs``).
    max_steps: int = 0
    #: Optimizer steps taken (transformers' ``global_step``).
    step: int = 0
    #: Training rounds finished (seeds each round's row order, so a resume replays it).
    round_index: int = 0
    #: Optimizer steps skipped for a NaN/inf loss or gradient.
    skipped_steps: int = 0
    #: Micro-batches of the last optimizer step (written when the step ends).
    step_micro_batches: int = 0
    #: The step of the last checkpoint saved (or resumed from); -1 before any.
    last_saved_step: int = -1
    #: The step of the last evaluation during the run, and its metrics; -1 / None before any.
    last_eval_step: int = -1
    last_eval_metrics: dict[str, float] | None = None
    #: The best saved checkpoint so far (evaluation runs with a saved checkpoint only).
    best: BestCheckpoint | None = None
    #: What the run summary reports: the first logged reward, the last metrics record, the peak memory.
    first_reward: float | None = None
    last_record: dict[str, float] = field(default_factory=dict)
    peak_gb: float = 0.0

    def counters(self) -> dict[str, int]:
        """The counters a checkpoint saves (``trainer_state.json``)."""
        return {"step": self.step, "round_index": self.round_index, "skipped_steps": self.skipped_steps}

    def restore_counters(self, saved: dict) -> None:
        """Take back what :meth:`counters` saved; the resumed step counts as saved."""
        self.step = int(saved["step"])
        self.round_index = int(saved["round_index"])
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        self.last_saved_step = self.step
