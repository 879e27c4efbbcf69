"""GRPO vs PPO on the same task, model and budget: a Markdown table and a PNG from one command.

    python bench/compare_grpo_ppo.py                                  # recipes/compare_grpo_ppo.yaml
    python bench/compare_grpo_ppo.py --max-steps 40 --out /tmp/cmp   # shorter
    python bench/compare_grpo_ppo.py --recipe my_task.yaml --grpo beta=0.0 --ppo kl_coef=0.02 vf_coef=0.5

Both algorithms train from the same recipe (model, dataset, rewards, LoRA, micro-batch, learning
rate, max_steps), each in its own process so that peak memory is measured separately, with the
same generation budget: ``per_device_train_batch_size × 2`` completions per round and 4 optimizer
steps per round (GRPO: G=8, num_iterations=2, steps_per_generation=2; PPO: G=2, ppo_epochs=2,
num_mini_batches=2). ``--grpo`` / ``--ppo`` take extra ``key=value`` settings for one side.

Writes ``compare_grpo_ppo.md`` (the tables), ``compare_grpo_ppo.png`` (reward vs optimizer steps and
vs training wall time) and ``compare_grpo_ppo.json`` into ``--report`` (default OUT), and each run
under ``OUT/grpo`` and ``OUT/ppo``.
Wall time is the sum of the logged ``time/step`` (generation, scoring, extra forwards and the
update; model loading excluded); memory is the peak the trainer logs (device memory on an
accelerator, the process's peak resident memory on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ALGORITHMS = ("grpo", "ppo")
# Each side's own settings; both give 2 micro-batches per round and 4 optimizer steps per round.
DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"num_generations": 8, "num_iterations": 2, "steps_per_generation": 2, "beta": 0.05},
    "ppo": {"num_generations": 2, "ppo_epochs": 2, "num_mini_batches": 2, "kl_coef": 0.05, "vf_coef": 0.5},
}
LABELS = {"grpo": "GRPO", "ppo": "PPO"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "compare_grpo_ppo.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "compare_grpo_ppo")
    parser.add_argument("--max-steps", type=int, default=None, help="override the recipe's max_steps (both runs)")
    parser.add_argument("--device", default=None, help="override the recipe's device (both runs)")
    parser.add_argument("--threads", type=int, default=None, help="OMP/torch CPU threads per run (default: torch's)")
    parser.add_argument("--grpo", nargs="*", default=[], metavar="KEY=VALUE", help="extra GRPO settings")
    parser.add_argument("--ppo", nargs="*", default=[], metavar="KEY=VALUE", help="extra PPO settings")
    parser.add_argument("--report", type=Path, default=None,
                        help="folder for compare_grpo_ppo.{md,png,json} (default: OUT)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the table and plot from OUT")
    parser.add_argument("--window", type=int, default=5, help="rounds averaged for the final reward")
    return parser.parse_args(argv)


def _overrides(algorithm: str, ns: argparse.Namespace) -> list[str]:
    values: dict[str, Any] = dict(DEFAULTS[algorithm])
    for item in getattr(ns, algorithm):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--{algorithm} {item!r}: expected KEY=VALUE")
        values[key] = value
    values.update(algorithm=algorithm, output_dir=str(ns.out / algorithm))
    if ns.max_steps is not None:
        values["max_steps"] = ns.max_steps
    if ns.device is not None:
        values["device"] = ns.device
    return [part for key, value in values.items() for part in (f"--{key}", str(value))]


def run(algorithm: str, ns: argparse.Namespace) -> dict[str, float]:
    """Train one algorithm in a fresh process; returns its wall time and CPU time (start-up included).

    CPU time is the robust number on a shared machine: other jobs stretch wall time, not the CPU
    seconds the run itself used (with --threads 1 it is close to the run's compute)."""
    out = ns.out / algorithm
    if out.exists():
        for name in ("metrics.jsonl", "summary.json"):
            (out / name).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "grpo_ascend.cli", "train", str(ns.recipe), *_overrides(algorithm, ns)]
    env = dict(os.environ)
    if ns.threads:
        env["OMP_NUM_THREADS"] = str(ns.threads)
    print("$ " + " ".join(cmd), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = {"wall_time_s": wall, "cpu_time_s": cpu}
    (ns.out / algorithm / "process.json").write_text(json.dumps(result))
    return result


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(algorithm: str, out: Path, window: int) -> dict[str, Any]:
    """Per-step curves and the table's numbers for one run."""
    metrics = _read(out / algorithm / "metrics.jsonl")
    if not metrics:
        raise SystemExit(f"{out / algorithm / 'metrics.jsonl'} is empty")
    summary = json.loads((out / algorithm / "summary.json").read_text())
    steps = [m["step"] for m in metrics]
    rewards = [m["reward"] for m in metrics]
    wall, total = [], 0.0
    for m in metrics:
        total += m["time/step"]
        wall.append(total)
    # Rewards are per round (every step of a round logs the round's reward): average whole rounds.
    rounds = [m["reward"] for m in metrics if m.get("time/generation", 0.0) > 0]
    last = rounds[-window:]
    times = [m["time/step"] for m in metrics]
    return {
        "algorithm": algorithm,
        "steps": steps,
        "reward": rewards,
        "wall_time": wall,
        "rounds": len(rounds),
        "reward_first": rounds[0],
        "reward_final": sum(last) / len(last),
        "accuracy_final": _mean_last(metrics, "rewards/accuracy/mean", window),
        "train_time_s": total,
        "time_per_step_s": sum(times) / len(times),
        "peak_memory_gb": max(m.get("memory/peak_gb", 0.0) for m in metrics),
        "run_wall_time_s": summary.get("wall_time_s"),
        **{f"process_{k}": v for k, v in _process(out / algorithm).items()},
    }


def _process(folder: Path) -> dict[str, float]:
    path = folder / "process.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _mean_last(metrics: list[dict[str, Any]], key: str, window: int) -> float | None:
    values = [m[key] for m in metrics if key in m and m.get("time/generation", 0.0) > 0][-window:]
    return sum(values) / len(values) if values else None


def _at(curve: dict[str, Any], fraction: float, smooth: int) -> tuple[int, float, float]:
    """(step, reward averaged over the ``smooth`` steps up to it, wall time) at a fraction of the run."""
    index = max(0, min(len(curve["steps"]) - 1, round(fraction * len(curve["steps"])) - 1))
    return curve["steps"][index], _smooth(curve["reward"], smooth)[index], curve["wall_time"][index]


def table(results: dict[str, dict[str, Any]], window: int, per_round: int, smooth: int) -> str:
    """Two Markdown tables: the summary and reward vs steps / wall time."""
    cols = [results[a] for a in ALGORITHMS]
    g, p = cols

    def row(label: str, values: list[str]) -> str:
        return f"| {label} | " + " | ".join(values) + " |"

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}×" if a else "n/a"

    lines = [
        "| | GRPO | PPO | PPO / GRPO |",
        "|---|---:|---:|---:|",
        row("rounds × completions per round", [f"{c['rounds']} × {per_round}" for c in cols] + [""]),
        row("optimizer steps", [str(c["steps"][-1]) for c in cols] + [""]),
        row("reward, first round", [f"{c['reward_first']:.3f}" for c in cols] + [""]),
        row(f"reward, final {window} rounds", [f"{c['reward_final']:.3f}" for c in cols] + [""]),
    ]
    if g["accuracy_final"] is not None and p["accuracy_final"] is not None:
        lines.append(row(f"accuracy, final {window} rounds", [f"{c['accuracy_final']:.3f}" for c in cols] + [""]))
    lines += [
        row("training wall time (s)", [f"{c['train_time_s']:.1f}" for c in cols] + [ratio(g["train_time_s"], p["train_time_s"])]),
        row("time per optimizer step (s)", [f"{c['time_per_step_s']:.3f}" for c in cols]
            + [ratio(g["time_per_step_s"], p["time_per_step_s"])]),
        row("peak memory (GB)", [f"{c['peak_memory_gb']:.3f}" for c in cols]
            + [ratio(g["peak_memory_gb"], p["peak_memory_gb"])]),
    ]
    if "process_cpu_time_s" in g and "process_cpu_time_s" in p:
        lines.append(row("process CPU time, whole run (s)", [f"{c['process_cpu_time_s']:.1f}" for c in cols]
                         + [ratio(g["process_cpu_time_s"], p["process_cpu_time_s"])]))
    lines += [
        "",
        f"| progress | step | GRPO reward (mean of {smooth} steps) | GRPO time (s) | PPO reward | PPO time (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for fraction in (0.25, 0.5, 0.75, 1.0):
        step, g_reward, g_time = _at(g, fraction, smooth)
        _, p_reward, p_time = _at(p, fraction, smooth)
        lines.append(f"| {fraction:.0%} | {step} | {g_reward:.3f} | {g_time:.1f} | {p_reward:.3f} | {p_time:.1f} |")
    return "\n".join(lines) + "\n"


def _smooth(values: list[float], width: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - width + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def plot(results: dict[str, dict[str, Any]], path: Path, smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for algorithm in ALGORITHMS:
        r = results[algorithm]
        label = (f"{LABELS[algorithm]} (peak {r['peak_memory_gb']:.2f} GB, {r['time_per_step_s']:.2f} s/step)")
        y = _smooth(r["reward"], smooth)
        axes[0].plot(r["steps"], y, label=label)
        axes[1].plot(r["wall_time"], y, label=label)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("training wall time (s)")
    for ax in axes:
        ax.set_ylabel(f"reward (mean over {smooth} steps)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("GRPO vs PPO: same model, task and number of sampled completions")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import describe  # bench/machine.py: what the figures were measured on

    print(f"machine: {describe()}", flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    report = ns.report or ns.out
    report.mkdir(parents=True, exist_ok=True)
    if not ns.report_only:
        for algorithm in ALGORITHMS:
            run(algorithm, ns)
    results = {a: summarise(a, ns.out, ns.window) for a in ALGORITHMS}
    text = table(results, ns.window, _round_size(ns), smooth=4 * ns.window)
    command = ("python bench/compare_grpo_ppo.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    paths = {ext: report / f"compare_grpo_ppo.{ext}" for ext in ("md", "png", "json")}
    paths["md"].write_text(f"Command: `{command}`\n\n{text}")
    plot(results, paths["png"], smooth=4 * ns.window)
    paths["json"].write_text(json.dumps(
        {"command": command,
         **{a: {k: v for k, v in r.items() if k not in ("steps", "reward", "wall_time")} for a, r in results.items()}},
        indent=1) + "\n")
    print(text)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _round_size(ns: argparse.Namespace) -> int:
    """Completions per round (from the GRPO run's config: per-device batch × steps_per_generation)."""
    from grpo_ascend.config.recipe import load_recipe, parse_overrides

    _, cfg = load_recipe(ns.recipe, parse_overrides(_overrides("grpo", ns)))
    return cfg.batch_plan().completions_per_generation


if __name__ == "__main__":
    sys.exit(main())
