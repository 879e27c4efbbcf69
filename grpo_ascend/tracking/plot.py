"""``grpo-ascend plot RUN_DIR [RUN_DIR ...]``: reward (per function; eval reward, greedy reward and pass@1
when the run evaluated), KL (tool calls per completion for a tool run without KL), length and step
time vs step."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from grpo_ascend.errors import ConfigError
from grpo_ascend.tracking.run_tracker import METRICS_FILE, read_jsonl


def _panels(records: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    keys = {k for r in records for k in r}
    reward_keys = ["reward", *sorted(k for k in keys if k.startswith("rewards/") and k.endswith("/mean"))]
    eval_keys = [k for k in ("eval/reward", "eval/greedy/reward", "eval/pass@1") if k in keys]
    panels = [("reward", [k for k in reward_keys if k in keys] + eval_keys)]
    if "kl" not in keys and "tools/calls_per_completion" in keys:  # a tool run without KL: its tool use
        panels.append(("tool calls per completion", ["tools/calls_per_completion"]))
    else:
        panels.append(("KL to reference", ["kl"] if "kl" in keys else []))
    panels.append(("completion length (tokens)",
                   [k for k in ("completion_length/mean", "eval/completion_length/mean") if k in keys]))
    panels.append(("seconds per step", [k for k in ("time/step", "time/generation", "time/training") if k in keys]))
    return panels


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
    panels = _panels([r for _, recs in runs for r in recs])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
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
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
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
