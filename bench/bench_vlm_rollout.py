"""Vision-language rollout throughput: grpo_ascend's RolloutEngine vs transformers ``model.generate``, side by side.

Both sample G completions for each of P prompts of the coloured-shapes task (grpo_ascend/vision/shapes_task.py:
one 28x28 picture and the same question per prompt) with the same model in one process, T = 1 with no top-k /
top-p, every completion running to ``--new-tokens`` (ours: ``ignore_eos``; generate: no EOS id), taking turns
(ours, generate, ours, ...) after one warm-up each. Each call includes its own preprocessing: ours is
``PromptRollout.generate_rows`` (chat template + processor per prompt, one prefill per prompt with its pixels,
then the batched decode); generate gets the processor's batch of the P prompts and their images and
``num_return_sequences=G`` (it expands every input, the pixels included, G times, so the vision tower and the
prompt's prefill run once per completion). Tokens/s counts generated tokens; each call's wall and process CPU
time are recorded, and the ratio ours/generate is taken per repeat (and over the repeats whose two calls kept
every thread busy, CPU >= 0.8 x threads x wall: on a shared machine the others are slowed by whoever else runs).

Models (bench/vlm_models.py): the built-in ``tiny-llava`` / ``tiny-qwen2_5_vl``, and ``random-llava-32k`` /
``random-qwen2_5_vl-32k``, random weights with sizes we did not tune (hidden 512, 8 layers, a 32,000-entry
vocabulary; 64 / 16 image tokens).

Examples::

    python bench/bench_vlm_rollout.py                                   # tiny-llava, torch's default threads
    python bench/bench_vlm_rollout.py --model random-qwen2_5_vl-32k --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import memory_before  # noqa: E402
from machine import describe  # noqa: E402
from vlm_models import MODELS, build_vlm  # noqa: E402

from grpo_ascend import device as devmod  # noqa: E402
from grpo_ascend.models.policy import load_tokenizer  # noqa: E402
from grpo_ascend.rollout.engine import RolloutEngine  # noqa: E402
from grpo_ascend.rollout.protocol import PromptRollout  # noqa: E402
from grpo_ascend.rollout.sampling import SamplingParams  # noqa: E402
from grpo_ascend.vision.images import row_images  # noqa: E402
from grpo_ascend.vision.shapes_task import coloured_shapes_dataset  # noqa: E402

#: (generated tokens, wall s, CPU s, peak bytes above the start) of one call.
Call = tuple[int, float, float, int]


def timed(fn: Any) -> tuple[Any, float, float, int]:
    """``fn()``'s result, wall and CPU seconds, and its peak memory (RSS high-water mark on the CPU)."""
    dev = torch.device("cpu")
    base = memory_before(dev)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0, devmod.memory_stats(dev)["peak"] - base


def run_ours(rollout: PromptRollout, rows: list[dict[str, Any]], params: SamplingParams, seed: int) -> Call:
    batch, wall, cpu, peak = timed(lambda: rollout.generate_rows(rows, params, torch.Generator().manual_seed(seed)))
    return int(batch.completion_lengths.sum()), wall, cpu, peak


def run_generate(model: Any, processor: Any, rows: list[dict[str, Any]], args: argparse.Namespace, seed: int) -> Call:
    def call() -> torch.Tensor:
        texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                {"type": "text", "text": r["prompt"][0]["content"]}]}],
                                               tokenize=False, add_generation_prompt=True) for r in rows]
        images = [row_images(r, i)[0] for i, r in enumerate(rows)]
        enc = processor(text=texts, images=images, return_tensors="pt", padding=True, add_special_tokens=False)
        if hasattr(model.model, "rope_deltas"):
            model.model.rope_deltas = None
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                                 num_return_sequences=args.G, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, pad_token_id=processor.tokenizer.pad_token_id)
        return out[:, enc["input_ids"].shape[1]:]

    torch.manual_seed(seed)
    out, wall, cpu, peak = timed(call)
    return out.numel(), wall, cpu, peak


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llava", choices=MODELS)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per engine (after a warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, processor = build_vlm(args.model)
    rows = [dict(r) for r in coloured_shapes_dataset(args.prompts, seed=3)]
    params = SamplingParams(num_generations=args.G, max_completion_length=args.new_tokens, temperature=1.0,
                            ignore_eos=True, max_prompt_length=None)
    rollout = PromptRollout(RolloutEngine(model, load_tokenizer(model, processor), params), processor=processor)
    prompt_len = len(rollout.generate_rows(rows[:1], SamplingParams(max_completion_length=1)).prompt_ids[0])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model} ({n_params / 1e6:.1f}M params, fp32) on cpu, torch threads {torch.get_num_threads()}; "
          f"{args.prompts} prompts of {prompt_len} tokens with one image each, G={args.G}, {args.new_tokens} new "
          f"tokens (EOS off), {args.repeats} repeats taking turns after a warm-up; load {os.getloadavg()[0]:.2f}")
    print(f"machine: {describe()}")
    results: dict[str, list[Call]] = {"ours": [], "generate": []}
    for rep in range(args.repeats + 1):
        calls = {"ours": run_ours(rollout, rows, params, rep), "generate": run_generate(model, processor, rows, args, rep)}
        if rep:
            for name, call in calls.items():
                results[name].append(call)
        shown = "  ".join(f"{n} {c[0] / c[1]:8.1f} tok/s ({c[1]:.2f} s, CPU {c[2]:.2f} s)" for n, c in calls.items())
        print(f"  [{'warm-up' if rep == 0 else f'run {rep}'}] {shown}  load {os.getloadavg()[0]:.2f}", flush=True)
    threads = torch.get_num_threads()
    clean = [o[2] >= 0.8 * threads * o[1] and g[2] >= 0.8 * threads * g[1] for o, g in zip(results["ours"], results["generate"])]
    ratios = [o[0] / o[1] / (g[0] / g[1]) for o, g in zip(results["ours"], results["generate"])]
    cpu_ratios = [o[0] / o[2] / (g[0] / g[2]) for o, g in zip(results["ours"], results["generate"])]
    print("\n| engine | tokens/s median (range) | s/call | CPU s/call | tokens/call | peak RSS above start (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, calls in results.items():
        tps = [c[0] / c[1] for c in calls]
        print(f"| {name} | {statistics.median(tps):.1f} ({min(tps):.1f}-{max(tps):.1f}) "
              f"| {statistics.median(c[1] for c in calls):.2f} | {statistics.median(c[2] for c in calls):.2f} "
              f"| {calls[0][0]} | {max(c[3] for c in calls) / 2**20:.0f} |")
    print(f"\nours/generate tokens/s: median {statistics.median(ratios):.2f}x (per repeat "
          f"{', '.join(f'{r:.2f}' for r in ratios)}); by CPU time {statistics.median(cpu_ratios):.2f}x; "
          f"load at the end {os.getloadavg()[0]:.2f}")
    if any(clean):
        kept = [r for r, c in zip(ratios, clean) if c]
        print(f"repeats where both calls kept {threads} thread(s) busy (CPU >= 0.8 x threads x wall): {len(kept)}/"
              f"{len(ratios)}, their median ratio {statistics.median(kept):.2f}x")
    else:
        print(f"no repeat kept {threads} thread(s) busy in both calls: the machine was shared; read the CPU-time ratio")


if __name__ == "__main__":
    main()
