"""Run tracking: metrics.jsonl, samples.jsonl, a live progress bar, the ``report_to`` trackers, a summary."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from grpo_ascend.tracking.trackers import (
    METRICS_FILE,
    SAMPLES_FILE,
    JsonlTracker,
    Tracker,
    check_report_to,
    make_tracker,
)

SUMMARY_FILE = "summary.json"
SAMPLES_TABLE = "samples"

# Progress-bar fields: (metric key, short label).
_BAR_FIELDS = (("reward", "reward"), ("kl", "kl"), ("completion_length/mean", "len"), ("time/step", "s/step"))


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL file (missing file → empty list); a torn last line is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    records = []
    for line in p.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_metrics(output_dir: str | Path, last_step: int) -> None:
    """Drop metric records after ``last_step`` (a resumed run rewrites them)."""
    for name in (METRICS_FILE, SAMPLES_FILE):
        p = Path(output_dir) / name
        if p.exists():
            kept = [r for r in read_jsonl(p) if r.get("step", 0) <= last_step]
            p.write_text("".join(json.dumps(r) + "\n" for r in kept))


class RunTracker:
    """Writes metrics.jsonl / samples.jsonl, feeds the ``report_to`` trackers and shows a progress bar.

    Only the main process (``enabled``) writes. ``report_to``: tracker names (see ``trackers.py``;
    ``jsonl``, the files here, is always on). ``config``: logged once to every tracker and to
    ``run_config.json``. Sample completions go to each tracker as a table named ``samples``.
    """

    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        *,
        enabled: bool = True,
        start_step: int = 0,
        disable_tqdm: bool = False,
        report_to: list[str] | tuple[str, ...] = (),
        config: dict[str, Any] | None = None,
    ):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.started = time.time()
        self.history: list[dict[str, Any]] = []
        self.trackers: list[Tracker] = []
        self._bar = None
        names = [n for n in check_report_to(list(report_to)) if n != "jsonl"]
        if enabled:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.trackers = [make_tracker(name, self.output_dir) for name in names]
            if config is not None:
                JsonlTracker(self.output_dir, "").log_config(config)
                for tracker in self.trackers:
                    tracker.log_config(config)
            if not disable_tqdm:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self.history.append(record)
        if not self.enabled:
            return
        with open(self.output_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log_metrics(scalars, step)
        if self._bar is not None:
            self._bar.set_postfix(
                {label: f"{metrics[key]:.3g}" for key, label in _BAR_FIELDS if metrics.get(key) is not None},
                refresh=False,
            )

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        if not self.enabled or not samples:
            return
        rows = [{k: _clean(v) for k, v in s.items()} for s in samples]
        with open(self.output_dir / SAMPLES_FILE, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        for tracker in self.trackers:
            tracker.log_table(SAMPLES_TABLE, rows, step)

    def close_bar(self) -> None:
        """End the progress bar's line (so an error printed next starts on a line of its own)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def abort(self) -> None:
        """After a failure: end the bar's line and finish the trackers' runs (no summary)."""
        self.close_bar()
        self._close_trackers()

    def _close_trackers(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def close(self, summary: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close the bar and the trackers, write summary.json and print a short run summary."""
        self.close_bar()
        self._close_trackers()
        summary = dict(summary or {})
        summary.setdefault("wall_time_s", round(time.time() - self.started, 2))
        if self.enabled:
            (self.output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
            lines = [f"  {k}: {v}" for k, v in summary.items()]
            print("run summary (" + str(self.output_dir / SUMMARY_FILE) + ")\n" + "\n".join(lines), flush=True)
        return summary
