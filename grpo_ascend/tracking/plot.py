"""``grpo-ascend plot RUN_DIR [RUN_DIR ...]``: reward (per function; eval reward, greedy reward and pass@1
when the run evaluated), KL, tool calls, length, step time, and for asynchronous rollouts staleness
and each side's idle time, vs step; panels a run never logged are left out."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from grpo_ascend.errors import ConfigError
from grpo_ascend.tracking.run_tracker import METRICS_FILE, read_jsonl

#: (title, metric names) of each panel a run may fill, in order; a panel none of whose metrics a run logged is
#: left out (no empty KL panel when beta is 0). The reward panel also takes every ``rewards/<fn>/mean``.
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward", "eval/reward", "eval/greedy/reward", "eval/pass@1"]),
    ("KL to reference", ["kl"]),
    ("tool calls per completion", ["tools/calls_per_completion"]),
    ("completion length (tokens)", ["completion_length/mean", "eval/completion_length/mean"]),
    ("seconds per step", ["time/step", "time/generation", "time/training"]),
    ("staleness (policy versions)", ["async/staleness_mean", "async/staleness_max"]),
    ("idle fraction (asynchronous rollouts)", ["async/producer_idle_fraction", "async/trainer_idle_fraction"]),
]


def panels_of(records: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels ``records`` fill, each with the metrics they logged."""
    keys = {k for r in records for k in r}
    per_function = sorted(k for k in keys if k.startswith("rewards/") and k.endswith("/mean"))
    out = []
    for title, names in PANELS:
        wanted = names[:1] + per_function + names[1:] if title == "reward" else names
        logged = [k for k in wanted if k in keys]
        if logged:
            out.append((title, logged))
    return out


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None, smooth: int = 1) -> Path:
    """Draw one figure overlaying every run; returns the PNG path (default: first run's plot.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for d in run_dirs:
        records = read_jsonl(Path(d) / METRICS_FILE)
        if not records:
            raise ConfigError(f"no metrics in {str(Path(d) / METRICS_FILE)!r}; is {str(d)!r} a run directory?")
        runs.append((Path(d), records))
    panels = panels_of([r for _, recs in runs for r in recs])
    rows = max(1, (len(panels) + 1) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, keys) in zip(axes.flat, panels):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        for run_dir, records in runs:
            for key in keys:
                points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
                if not points:
                    continue
                steps, values = zip(*points)
                values = _moving_average(list(values), smooth)
                label = key if len(runs) == 1 else f"{run_dir.name}: {key}"
                ax.plot(steps, values, label=label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out) if out is not None else runs[0][0] / "plot.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _moving_average(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/plot.png of the first run)")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window in steps (default 1)")


def run_plot(ns: argparse.Namespace) -> int:
    path = plot_runs(ns.run_dirs, ns.out, ns.smooth)
    print(f"wrote {path}")
    return 0
