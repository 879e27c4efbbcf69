"""Rollout tokens/s at 1 and 2 threads, ours vs ``generate``, alternated in one process.

Each round runs, for every thread count in turn (``torch.set_num_threads``), our engine and then
``generate(num_return_sequences=G)`` on the same prompts with EOS disabled (fixed-length
sampling, T = 1), so thread counts and engines see the same machine load. After a warm-up round
it prints per-call wall time, process CPU time and the load average, then medians and ranges.

Examples::

    python bench/thread_scaling.py --model-config small --prompts 4 --new-tokens 64
    python bench/thread_scaling.py --model-config qwen2.5-0.5b-2l --prompts 2 --new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import load_model, make_prompts, run_generate, run_ours  # noqa: E402

from grpo_ascend.rollout.engine import RolloutEngine  # noqa: E402
from grpo_ascend.rollout.sampling import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="small")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--length-bucket", type=int, default=64)
    args = parser.parse_args(argv)
    from machine import describe  # bench/machine.py: what the figures were measured on

    print(f"machine: {describe(args.threads)}", flush=True)
    dev = torch.device("cpu")
    model, tokenizer = load_model(args.model_config, torch.float32, dev)
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_len)
    engine = RolloutEngine(model, tokenizer)
    params = SamplingParams(
        num_generations=args.G, max_completion_length=args.new_tokens, ignore_eos=True,
        max_prompt_length=None, length_bucket=args.length_bucket,
    )
    counts = [int(t) for t in args.threads.split(",")]
    print(f"{args.model_config}: {args.prompts} prompts x G={args.G}, {args.new_tokens} new tokens, EOS off, "
          f"threads {counts} alternated, {args.repeats} rounds after a warm-up; load {os.getloadavg()[0]:.2f}")
    runs: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    for rep in range(args.repeats + 1):
        for threads in counts:
            torch.set_num_threads(threads)
            ours = run_ours(engine, prompts, params, dev, seed=rep)
            ref = run_generate(model, tokenizer, prompts, args, [], dev, seed=rep)
            for name, (tokens, wall, _peak, cpu) in (("ours", ours), ("generate", ref)):
                if rep:
                    runs.setdefault((threads, name), []).append((tokens / wall, wall, cpu))
                print(f"  [{'warm-up' if rep == 0 else f'round {rep}'}] {threads} thread(s) {name:8s} "
                      f"{tokens / wall:7.1f} tok/s  wall {wall:6.2f} s  CPU {cpu:6.2f} s  load {os.getloadavg()[0]:.2f}",
                      flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    print("| threads | engine | tokens/s median (range) | wall s/call | CPU s/call | ours/generate tokens/s (range) |")
    print("|---:|---|---:|---:|---:|---:|")
    for threads in counts:
        for name in ("ours", "generate"):
            r = runs[(threads, name)]
            tps = [x[0] for x in r]
            ratio = ""
            if name == "ours":
                rr = [o[0] / g[0] for o, g in zip(r, runs[(threads, "generate")])]
                ratio = f"{statistics.median(rr):.2f}x ({min(rr):.2f}-{max(rr):.2f})"
            print(f"| {threads} | {name} | {statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f}) | "
                  f"{statistics.median(x[1] for x in r):.2f} | {statistics.median(x[2] for x in r):.2f} | {ratio} |")


if __name__ == "__main__":
    main()
