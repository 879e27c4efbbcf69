"""Whole GRPO runs as a user pays them: one TRL-style script, run with TRL's trainer and with ours.

The script (:func:`user_script`) is written once in TRL's vocabulary and run twice, the only
difference being where ``GRPOConfig`` / ``GRPOTrainer`` come from (``trl`` or ``grpo_ascend``),
each in a fresh process. It times what a user waits for: importing the trainer, building it (model load, LoRA,
reference), ``trainer.train()`` (first step, warm-up and every later step), and the final
``save_model``; a TRL callback stamps each optimizer-step end (ours runs TRL callbacks too), so the
first step and the steady steps are printed apart. Peak RSS is the process's whole-life VmHWM.

The model is one neither trainer was shaped for: a random-weight Qwen2 built from transformers'
defaults with hidden 512, 8 layers, 8 query / 4 key-value heads, intermediate 1,376 and a
4,096-token vocabulary (``random-25m-v4k``; the built-in byte-level tokenizer, ids past its ~550
entries decode to nothing). Random weights almost never draw EOS (about 1 in 4,096 per token),
so completions run to the limit on both sides without forcing; mean lengths are printed.
Defaults: 4 prompts × 8 completions × 64 tokens per step (micro-batches of 8, 4 accumulation
steps), LoRA r16 / alpha 32 on all linear layers, β = 0.04, fp32, 5 steps, torch's default thread
count, runs alternating ours / TRL (``--repeats`` pairs).

``--isa avx2`` caps torch's kernels at AVX2 on an AVX-512 machine (see :mod:`machine`).

Examples::

    python bench/bench_whole_run.py                      # default threads, 2 pairs of runs
    python bench/bench_whole_run.py --threads 1 --isa avx2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

IMPLS = ("ours", "trl")


def user_script(GRPOConfig: Any, GRPOTrainer: Any, model_dir: str, out_dir: str, opts: dict[str, Any],
                stamps: list[float]) -> dict[str, Any]:
    """A plain TRL GRPO script; returns the seconds of each stage and the mean completion length."""
    from bench_trainer import rule_reward
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback

    from grpo_ascend.data.synthetic import arithmetic_dataset

    class StepEnds(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = arithmetic_dataset(n=256, seed=0)
    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=opts["micro_batch"],
        gradient_accumulation_steps=opts["prompts"] * 8 // opts["micro_batch"],
        num_generations=8, max_completion_length=opts["new_tokens"], beta=0.04, learning_rate=1e-5,
        max_steps=opts["steps"], logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
        seed=0, disable_tqdm=True,
    )
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[rule_reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[StepEnds()])
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    trainer.save_model(out_dir)
    t3 = time.perf_counter()
    lengths = [r[k] for r in trainer.state.log_history for k in ("completions/mean_length", "completion_length/mean")
               if k in r]
    return {"setup_s": t1 - t0, "train_s": t2 - t1, "save_s": t3 - t2, "whole_s": t3 - t0, "train_start": t1,
            "completion_len": statistics.fmean(lengths) if lengths else float("nan")}


def worker(impl: str, opts: dict[str, Any], result: str) -> None:
    import torch  # both trainers import it first; what follows is what each adds
    from bench_trainer import status_kib
    from machine import describe

    model_dir = opts["model_dir"]
    started = time.perf_counter()
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpo_ascend import GRPOConfig, GRPOTrainer
    imported = time.perf_counter() - started
    stamps: list[float] = []
    with tempfile.TemporaryDirectory(prefix=f"whole-run-{impl}-") as out:
        data = user_script(GRPOConfig, GRPOTrainer, model_dir, out, opts, stamps)
    data["import_s"] = imported
    data["whole_s"] += imported
    ends = [data.pop("train_start"), *stamps]
    data["step_s"] = [b - a for a, b in zip(ends, ends[1:])]
    data["peak_rss_mib"] = status_kib("VmHWM") / 1024
    data["machine"] = describe(torch.get_num_threads())
    Path(result).write_text(json.dumps(data))


def run(impl: str, opts: dict[str, Any], env: dict[str, str], log_dir: Path, index: int) -> dict[str, Any]:
    out, log = log_dir / f"{impl}-{index}.json", log_dir / f"{impl}-{index}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--opts", json.dumps(opts), "--result", str(out)]
    with open(log, "w") as handle:
        code = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise SystemExit(f"{impl} run failed (exit {code}); log {log}:\n" + "".join(log.read_text().splitlines(True)[-30:]))
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: torch's default)")
    parser.add_argument("--isa", default="native", choices=["native", "avx2"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs (ours then TRL, alternating)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (8 completions each)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8,
                        help="completions per micro-batch (per_device_train_batch_size; TRL's default 8); 32 with 4 "
                             "prompts is one micro-batch per step")
    parser.add_argument("--model", default="random-25m-v4k",
                        help="a random-weight model of bench_random_model.py, or the built-in tiny / small")
    parser.add_argument("--keep-logs", default=None)
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--opts", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, json.loads(args.opts), args.result)
        return
    from bench_random_model import build_random_model
    from machine import isa_environment

    if args.model in ("tiny", "small"):
        from grpo_ascend.models.tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(args.model))
    else:
        model_dir = str(build_random_model(args.model))  # once, before the runs
    opts = {"model_dir": model_dir, "steps": args.steps, "prompts": args.prompts, "new_tokens": args.new_tokens,
            "micro_batch": args.micro_batch}
    if (args.prompts * 8) % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide the step's {args.prompts * 8} completions")
    env = dict(os.environ, **isa_environment(args.isa))
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    log_dir = Path(args.keep_logs or tempfile.mkdtemp(prefix="bench-whole-run-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in IMPLS}
    for rep in range(args.repeats):
        for impl in IMPLS:
            r = run(impl, opts, env, log_dir, rep)
            runs[impl].append(r)
            print(f"  [{impl} {rep + 1}] whole {r['whole_s']:.1f} s = import {r['import_s']:.1f} + setup {r['setup_s']:.1f} + train {r['train_s']:.1f} "
                  f"(steps {', '.join(f'{t:.1f}' for t in r['step_s'])}) + save {r['save_s']:.2f}; peak RSS "
                  f"{r['peak_rss_mib']:.0f} MiB; completion length {r['completion_len']:.1f}", flush=True)
    print(f"machine: {runs['ours'][0]['machine']}")
    print(f"{args.model}, {args.prompts} prompts × 8 × {args.new_tokens} tokens, micro-batches of {args.micro_batch}, "
          f"{args.steps} steps, LoRA r16, β 0.04, fp32")
    for key, label in (("whole_s", "whole run"), ("train_s", "train()")):
        pairs = [o[key] / t[key] for o, t in zip(runs["ours"], runs["trl"])]
        print(f"{label}: ours {', '.join(f'{r[key]:.1f}' for r in runs['ours'])} s, TRL "
              f"{', '.join(f'{r[key]:.1f}' for r in runs['trl'])} s; ratio per pair {', '.join(f'{p:.2f}' for p in pairs)}, "
              f"median {statistics.median(pairs):.2f}×")
    later = [statistics.median(o["step_s"][1:]) / statistics.median(t["step_s"][1:]) for o, t in zip(runs["ours"], runs["trl"])
             if len(o["step_s"]) > 1]
    first = [o["step_s"][0] / t["step_s"][0] for o, t in zip(runs["ours"], runs["trl"])]
    print(f"first step ratio {', '.join(f'{p:.2f}' for p in first)}; later steps (median) ratio "
          f"{', '.join(f'{p:.2f}' for p in later)}")
    rss = [o["peak_rss_mib"] / t["peak_rss_mib"] for o, t in zip(runs["ours"], runs["trl"])]
    ours_rss = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in runs["ours"])
    trl_rss = ", ".join(f"{r['peak_rss_mib']:.0f}" for r in runs["trl"])
    print(f"peak RSS: ours {ours_rss} MiB, TRL {trl_rss} MiB; ratio {', '.join(f'{p:.2f}' for p in rss)}")


if __name__ == "__main__":
    main()
