"""Where one GRPO round's time goes, per phase and operator: torch.profiler over our trainer's round.

Runs ``bench_trainer.py``'s setup for our trainer (same model, prompts, LoRA, batch and settings),
trains one warm-up round, profiles the second, and prints per phase (generation, reward,
reference, training; training is what runs outside the named phases) the wall time, the summed
self CPU time of the operators and the largest operators. ``--fused-lora off`` /
``--host-malloc adaptive`` switch off the fused LoRA kernel / the glibc thresholds to see what
each one changes.

Examples::

    python bench/profile_training.py                          # random-25m, 1 thread
    python bench/profile_training.py --model-config small --threads 2 --fused-lora off
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _phase_labels() -> None:
    """Label every PhaseTimer phase with a profiler range named ``##<phase>``."""
    from torch.profiler import record_function

    from grpo_ascend.tracking import phases

    plain = phases.PhaseTimer.phase

    @contextlib.contextmanager
    def labelled(self: Any, name: str):  # type: ignore[no-untyped-def]
        with record_function("##" + name), plain(self, name):
            yield

    phases.PhaseTimer.phase = labelled  # type: ignore[method-assign]


def breakdown(prof: Any, top: int) -> dict[str, tuple[float, float, list[tuple[str, float]]]]:
    """phase -> (wall ms, operators' self CPU ms, the ``top`` largest operators by self CPU ms)."""
    walls: dict[str, float] = collections.defaultdict(float)
    per: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for event in prof.events():
        if event.name.startswith("##"):
            walls[event.name[2:]] += (event.time_range.end - event.time_range.start) / 1e3
            continue
        phase, parent = "training", event.cpu_parent
        while parent is not None:
            if parent.name.startswith("##"):
                phase = parent.name[2:]
            parent = parent.cpu_parent
        per[phase][event.name] += event.self_cpu_time_total / 1e3
    return {phase: (walls.get(phase, 0.0), sum(ops.values()),
                    sorted(ops.items(), key=lambda kv: -kv[1])[:top]) for phase, ops in per.items()}


def main(argv: list[str] | None = None) -> None:
    import bench_trainer as bt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="random-25m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=8, help="completions per micro-batch (32: one per step)")
    parser.add_argument("--fused-lora", default="on", choices=["on", "off"])
    parser.add_argument("--host-malloc", default="tuned", choices=["tuned", "adaptive"])
    parser.add_argument("--top", type=int, default=10, help="operators listed per phase")
    args = parser.parse_args(argv)
    from machine import describe  # bench/machine.py: what the figures were measured on

    print(f"machine: {describe(args.threads)}", flush=True)
    s = bt.Settings(threads=args.threads, model_config=args.model_config, host_malloc=args.host_malloc,
                    micro_batch=args.micro_batch, grad_accum=4 * bt.Settings.num_generations // args.micro_batch)
    device, model_dir, _ = bt._setup(s, "ours")
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    from grpo_ascend import GRPOConfig, GRPOTrainer

    _phase_labels()
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), device=s.device, seed=s.seed, max_steps=2,
        per_device_train_batch_size=s.micro_batch, gradient_accumulation_steps=s.grad_accum,
        num_generations=s.num_generations, max_completion_length=s.new_tokens, temperature=1.0, beta=s.beta,
        loss_type=s.loss_type, learning_rate=s.learning_rate, save_steps=0, log_completions_steps=0,
        disable_tqdm=True, fused_lora=args.fused_lora == "on",
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[bt.rule_reward], args=cfg, train_dataset=bt.dataset(s),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=bt.lora_config(s))
    trainer.rollout.params.ignore_eos = True  # every completion at full length, as bench_trainer's default
    plain_round, rounds = trainer.train_round, []

    def profiled_round() -> None:
        rounds.append(None)
        if len(rounds) == 1:
            return plain_round()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            plain_round()
            wall = time.perf_counter() - start
        print(f"{args.model_config}, {args.threads} thread(s), fused LoRA {args.fused_lora}, host malloc "
              f"{args.host_malloc}: round {wall:.2f} s under the profiler")
        for phase, (phase_wall, ops, top) in breakdown(prof, args.top).items():
            shown = ", ".join(f"{name.removeprefix('aten::')} {ms:.0f}" for name, ms in top)
            wall_text = f"wall {phase_wall:.0f} ms, " if phase_wall else ""
            print(f"  {phase}: {wall_text}operators {ops:.0f} ms: {shown}")

    trainer.train_round = profiled_round  # type: ignore[method-assign]
    trainer.train()


if __name__ == "__main__":
    main()
