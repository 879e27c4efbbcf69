"""Which saved checkpoint is the best (``metric_for_best_model``), and ``OUTPUT_DIR/best`` pointing at it.

A checkpoint can be the best only when its step was evaluated: each in-run evaluation is noted
(:meth:`BestCheckpointTracker.note_evaluation`), and a save at that step asks for the checkpoint to
keep (:meth:`~BestCheckpointTracker.candidate`), which ``save_total_limit`` then never deletes.
"""

from __future__ import annotations

from pathlib import Path

from grpo_ascend.checkpoints.best import read_best_pointer, write_best_pointer
from grpo_ascend.config.configs import BaseRLConfig
from grpo_ascend.eval_metrics import best_metric_key, greater_is_better, is_better
from grpo_ascend.trainers.run_state import BestCheckpoint, RunState


class BestCheckpointTracker:
    """Keeps ``run.best`` and ``run.last_eval_*`` (see :class:`~grpo_ascend.trainers.run_state.RunState`)."""

    def __init__(self, args: BaseRLConfig, run: RunState, is_main_process: bool):
        self.args = args
        self.run = run
        self.is_main_process = is_main_process

    def note_evaluation(self, metrics: dict[str, float]) -> None:
        """The run's evaluation at the current step returned ``metrics``."""
        self.run.last_eval_metrics = metrics
        self.run.last_eval_step = self.run.step

    def candidate(self) -> Path | None:
        """Before saving the current step: the checkpoint to keep as the best (this one if its evaluation wins)."""
        run = self.run
        if run.last_eval_metrics is not None and run.last_eval_step == run.step:
            key = best_metric_key(self.args, run.last_eval_metrics)
            value = float(run.last_eval_metrics[key])
            if is_better(value, None if run.best is None else run.best.value, greater_is_better(self.args)):
                run.best = BestCheckpoint(run.step, value, key)
        return self.path()

    def path(self) -> Path | None:
        """The best checkpoint's folder, or None before any."""
        best = self.run.best
        return None if best is None else Path(self.args.output_dir) / f"checkpoint-{best.step}"

    def write_pointer(self) -> None:
        """After a save: point OUTPUT_DIR/best at the best checkpoint (main process)."""
        path = self.path()
        if path is not None and self.is_main_process:
            assert self.run.best is not None
            write_best_pointer(self.args.output_dir, path, self.run.best.metric, self.run.best.value)

    def restore(self) -> None:
        """On resume: the best so far from best.json (if it names a step not after the resumed one)."""
        self.run.last_eval_step = self.run.step  # the resumed checkpoint's step was evaluated before it was saved
        record = read_best_pointer(self.args.output_dir)
        if record is not None and int(record["step"]) <= self.run.step:
            self.run.best = BestCheckpoint(int(record["step"]), float(record["value"]), str(record["metric"]))
