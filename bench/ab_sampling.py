"""Whole rollouts with the previous sampler (``git show REV:grpo_ascend/rollout/sampling.py``) vs the current one.

Alternates the two (old, new, old, new, ...) on the same engine and prompts after a warm-up
each, EOS disabled, and prints per-call wall and process CPU time. The old file is loaded as a
separate module and swapped into the engine's ``next_tokens``.

Example::

    python bench/ab_sampling.py --rev 0165a42 --model qwen2.5-0.5b-2l --prompts 2 --new-tokens 64
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rollout import load_model, make_prompts  # noqa: E402

from grpo_ascend.rollout import decoding  # noqa: E402
from grpo_ascend.rollout.engine import RolloutEngine  # noqa: E402
from grpo_ascend.rollout.sampling import SamplingParams, next_tokens  # noqa: E402


def load_old(rev: str):
    source = subprocess.run(
        ["git", "show", f"{rev}:grpo_ascend/rollout/sampling.py"], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout
    path = Path(tempfile.mkdtemp()) / "sampling_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampling_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sampling_old"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="git revision holding the previous sampling.py")
    parser.add_argument("--model", default="qwen2.5-0.5b-2l")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from machine import describe  # bench/machine.py: what the figures were measured on

    print(f"machine: {describe(args.threads)}", flush=True)
    torch.set_num_threads(args.threads)
    old = load_old(args.rev)
    model, tokenizer = load_model(args.model, torch.float32, torch.device("cpu"))
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_len)
    engine = RolloutEngine(model, tokenizer)
    params = SamplingParams(max_completion_length=args.new_tokens, ignore_eos=True, max_prompt_length=None)
    variants = {"old": old.next_tokens, "new": next_tokens}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    print(f"{args.model}, {args.prompts} prompts x G=8, {args.new_tokens} new tokens, threads {args.threads}, "
          f"load {os.getloadavg()[0]:.2f}")
    for rep in range(args.repeats + 1):
        for name, fn in variants.items():
            decoding.next_tokens = fn
            t0, c0 = time.perf_counter(), time.process_time()
            engine.generate(prompts, params, torch.Generator().manual_seed(rep))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if rep:
                times[name].append((wall, cpu))
            print(f"  [{'warm-up' if rep == 0 else f'run {rep}'}] {name}: wall {wall:.2f} s, CPU {cpu:.2f} s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    decoding.next_tokens = next_tokens
    for name, runs in times.items():
        cpus = [c for _, c in runs]
        walls = [w for w, _ in runs]
        print(f"{name}: CPU s/call median {statistics.median(cpus):.2f} (range {min(cpus):.2f}-{max(cpus):.2f}), "
              f"wall median {statistics.median(walls):.2f} (range {min(walls):.2f}-{max(walls):.2f})")
    ratio = [o[1] / n[1] for o, n in zip(times["old"], times["new"])]
    print(f"old / new CPU time per call: median {statistics.median(ratio):.2f}x (range {min(ratio):.2f}-{max(ratio):.2f})")


if __name__ == "__main__":
    main()
