"""What a run records: metrics.jsonl and the trackers (one record per logged optimizer step), TRL's
``state.log_history`` entries, sample completions, and the run summary (summary.json, ``TrainOutput``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from grpo_ascend import device as dev
from grpo_ascend.config.configs import BaseRLConfig, BatchPlan
from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.experience import Experience
from grpo_ascend.tracking.phases import PhaseTimer
from grpo_ascend.tracking.run_tracker import RunTracker, truncate_metrics
from grpo_ascend.trainers.run_state import RunState
from grpo_ascend.trainers.surface import EventHub
from grpo_ascend.trainers.trl_logs import TRLLogHistory, training_flops_per_token


@dataclass
class RoundLog:
    """What a round's optimizer steps log besides their own: the round's metrics and phase timings."""

    metrics: dict[str, float]
    timer: PhaseTimer
    prep_seconds: float
    steps: int = 0


class RunRecorder:
    """Records one run; :meth:`begin` opens the tracker (main process writes), :meth:`finish` closes it.

    ``events``: where TRL's log entries go (``state.log_history`` and ``on_log``); ``scheduler``
    gives the logged learning rate, ``sampler`` the epoch.
    """

    def __init__(self, *, args: BaseRLConfig, plan: BatchPlan, run: RunState, events: EventHub,
                 ranks: Ranks, device: Any, scheduler: Any, sampler: Any, policy: nn.Module, is_main_process: bool):
        self.args = args
        self.plan = plan
        self.run = run
        self.events = events
        self.ranks = ranks
        self.device = device
        self.scheduler = scheduler
        self.sampler = sampler
        self.policy = policy
        self.is_main_process = is_main_process
        self.tracker: RunTracker | None = None
        self._trl_log: TRLLogHistory | None = None

    def begin(self) -> None:
        """Prepare the output folder (metrics past the resumed step dropped) and open the tracker."""
        args, run = self.args, self.run
        if self.is_main_process:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            truncate_metrics(args.output_dir, run.step)
            print(self.plan.describe() + f"; {self.run.max_steps} optimizer steps", flush=True)
        self.tracker = RunTracker(args.output_dir, self.run.max_steps, enabled=self.is_main_process,
                                  start_step=run.step, disable_tqdm=args.disable_tqdm,
                                  report_to=args.report_to, config=args.to_dict())
        run.first_reward, run.last_record, run.peak_gb = None, {}, 0.0
        self.events.state.global_step = run.step
        self._trl_log = TRLLogHistory(self.events.state, getattr(args, "loss_type", ""),
                                      getattr(args, "entropy_coef", 0.0), training_flops_per_token(self.policy),
                                      self.plan.completions_per_step)

    def step(self, step_metrics: dict[str, float], log: RoundLog, exp: Experience, started: float,
             micro_batches: int | None) -> None:
        """Record the optimizer step just counted; ``micro_batches``: its count, logged when packed by tokens."""
        args, run = self.args, self.run
        assert self.tracker is not None and self._trl_log is not None
        log.steps += 1
        train_time = time.perf_counter() - started
        step_peak = dev.memory_stats(self.device)["peak"] / 2**30
        run.peak_gb = max(run.peak_gb, step_peak, *log.timer.peak_gb.values())
        if micro_batches is not None:
            step_metrics = {**step_metrics, "micro_batches": float(micro_batches)}
        if log.steps == 1:
            self._trl_log.add_round(log.metrics, exp, self.ranks)
        self._trl_log.add_step({**step_metrics, "learning_rate": self.scheduler.get_last_lr()[0],
                                "time/step": train_time + (log.prep_seconds if log.steps == 1 else 0.0)})
        if run.step % args.logging_steps == 0 or run.step == self.run.max_steps:
            self._log_step(step_metrics, log, train_time, step_peak)
        self.tracker.advance()
        if args.log_completions_steps and run.step % args.log_completions_steps == 0:
            self.tracker.log_samples(run.step, exp.samples(args.num_completions_to_print))

    def _log_step(self, step_metrics: dict[str, float], log: RoundLog, train_time: float, step_peak: float) -> None:
        """One metrics.jsonl record; the round's phases are charged to its first step (zeros after)."""
        run = self.run
        assert self.tracker is not None and self._trl_log is not None
        first = log.steps == 1
        prep = log.prep_seconds if first else 0.0
        phases = {k: (v if first else 0.0) for k, v in log.timer.metrics().items()}
        record = {
            **step_metrics,
            **log.metrics,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "epoch": self.sampler.epochs_done,
            "skipped_steps": float(run.skipped_steps),
            **phases,
            "time/training": train_time,
            "time/step": train_time + prep,
            "tokens_per_second": log.metrics.get("tokens_generated", 0.0) / max(prep, 1e-9) if first else 0.0,
            "memory/peak_gb": run.peak_gb,
            "memory/peak_gb/training": step_peak,
            "memory/allocated_gb": dev.memory_stats(self.device)["allocated"] / 2**30,
        }
        self.tracker.log(run.step, record)
        if run.step % self.args.logging_steps == 0:  # TRL's entries; a last step off them waits for the summary
            self.events.log({**record, **self._trl_log.flush()})
        if run.first_reward is None:
            run.first_reward = record.get("reward")
        run.last_record = record

    def evaluation(self, record: dict[str, float]) -> None:
        """An evaluation's metrics: into metrics.jsonl and the trackers while a run is open, and TRL's log."""
        if self.tracker is not None:
            self.tracker.log(self.run.step, record)
        self.events.log(record)

    def finish(self, export_dir: str | None) -> tuple[dict[str, Any], Any]:
        """Close the tracker with the run summary; (the summary, transformers' ``TrainOutput``)."""
        from transformers.trainer_utils import TrainOutput

        run = self.run
        assert self.tracker is not None and self._trl_log is not None
        summary = {
            "steps": run.step,
            "reward_first": run.first_reward,
            "reward_last": run.last_record.get("reward"),
            "skipped_steps": run.skipped_steps,
            "peak_memory_gb": round(run.peak_gb, 3),
            "output_dir": self.args.output_dir,
        }
        if export_dir:
            summary["adapter"] = export_dir
        closed = self.tracker.close(summary)
        train_loss, metrics = self._trl_log.summary()
        metrics["epoch"] = self.sampler.epochs_done
        self.events.log(metrics)
        return closed, TrainOutput(run.step, train_loss, metrics)
