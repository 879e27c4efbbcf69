"""PPO on gymnasium's Pendulum-v1 with a vector of environments, the data kept on the device.

The classic-control run the design notes start from: an on-device rollout buffer and the same
vectorised GAE and PPO losses as the language-model trainer (see grpo_ascend/examples_support/pendulum/)::

    python examples/pendulum_ppo.py                          # 8 sync envs, 100k steps (~1 min on a CPU)
    python examples/pendulum_ppo.py --vectorization-mode async --num-envs 16
    python examples/pendulum_ppo.py --total-timesteps 20000 --plot pendulum.png --json pendulum.json

It prints one line per update, then the deterministic policy's mean return next to a uniformly
random policy's on the same evaluation seeds (Pendulum returns are negative; about -1200 is random,
above -200 is solved).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from grpo_ascend.examples_support.pendulum import ControlPPOConfig, train_control_ppo


def parse_args(argv: list[str] | None = None) -> tuple[ControlPPOConfig, argparse.Namespace]:
    """Every ControlPPOConfig field as a --flag, plus output and thread options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(ControlPPOConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 is fastest for these small MLPs on a busy machine")
    parser.add_argument("--json", type=Path, default=None, help="write the history and summary here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of return vs steps here")
    ns = parser.parse_args(argv)
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ControlPPOConfig)}
    return ControlPPOConfig(**values), ns


def _plot(history: list[dict[str, float]], summary: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([h["timesteps"] for h in history], [h["episode_return"] for h in history], label="PPO (training episodes)")
    ax.axhline(summary["random_return"], color="grey", linestyle="--", label="random policy")
    ax.axhline(summary["eval_return"], color="green", linestyle=":", label="PPO final (deterministic)")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("episode return")
    ax.set_title("PPO on Pendulum-v1")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    cfg, ns = parse_args(argv)
    torch.set_num_threads(max(1, ns.threads))

    def log(m: dict[str, float]) -> None:
        print(
            f"update {int(m['update']):4d}  steps {int(m['timesteps']):7d}  return {m['episode_return']:8.1f}  "
            f"value_loss {m['value_loss']:.3f}  explained_var {m['explained_variance']:.2f}  "
            f"clip {m['clip_fraction']:.3f}  kl {m['approx_kl']:.4f}  {m['steps_per_second']:.0f} steps/s",
            flush=True,
        )

    result = train_control_ppo(cfg, log)
    summary = {k: result[k] for k in ("timesteps", "wall_time_s", "steps_per_second", "eval_return", "random_return")
               if k in result}
    print(f"device {result['device']}, {cfg.num_envs} {cfg.vectorization_mode} envs: "
          + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))
    if ns.json:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps({"config": result["config"], "summary": summary, "history": result["history"]},
                                      indent=1))
    if ns.plot and "eval_return" in summary:
        _plot(result["history"], summary, ns.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
