"""Where one rollout's decode time goes: torch.profiler over the engine's decode steps, by category.

Runs one warm-up rollout, then profiles a second one (EOS disabled, every row to ``--new-tokens``)
and sums the profiler's self CPU time of the decode phase's operators into categories: matrix
multiplies (split into the LM head and the rest), attention (SDPA), sampling (``next_tokens``),
KV-cache writes, and everything else (element-wise kernels, norms, rotary, masks, indexing).
"Python / dispatch" is the decode's wall time minus the operators' self time. Prefill operators are
excluded (the prefill runs before the first profiled step marker).

Examples::

    python bench/profile_decode.py --model small --threads 1
    python bench/profile_decode.py --model qwen2.5-0.5b-2l --prompts 2 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rollout import load_model, make_prompts  # noqa: E402

from grpo_ascend.rollout import (
    decoding,  # noqa: E402
    kv_cache,  # noqa: E402
)
from grpo_ascend.rollout.engine import RolloutEngine  # noqa: E402
from grpo_ascend.rollout.sampling import SamplingParams  # noqa: E402

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
ATTENTION_PREFIX = "aten::_scaled_dot_product"


def load(name: str):
    """Any of bench_rollout's models, fp32 on the CPU."""
    return load_model(name, torch.float32, torch.device("cpu"))


def labelled(fn, label: str):
    def wrapper(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    return wrapper


def categorise(events, decode_start_us: float) -> dict[str, float]:
    """Self CPU ms per category over the events that start after ``decode_start_us``."""
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if e.time_range.start < decode_start_us or e.name.startswith("##"):
            continue
        parents, p = set(), e.cpu_parent
        while p is not None:
            parents.add(p.name)
            p = p.cpu_parent
        self_ms = e.self_cpu_time_total / 1e3
        if "##sampling" in parents:
            out["sampling"] += self_ms
        elif "##cache_update" in parents:
            out["KV-cache writes"] += self_ms
        elif e.name in MATMUL_OPS:
            out["matmul: LM head" if "##lm_head" in parents else "matmul: layers"] += self_ms
        elif e.name.startswith(ATTENTION_PREFIX):
            out["attention (SDPA)"] += self_ms
        else:
            out["other ops"] += self_ms
    return dict(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--length-bucket", type=int, default=64)
    parser.add_argument("--table", action="store_true", help="also print the profiler's top operators")
    args = parser.parse_args(argv)
    from machine import describe  # bench/machine.py: what the figures were measured on

    print(f"machine: {describe(args.threads)}", flush=True)

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_len)
    engine = RolloutEngine(model, tokenizer)
    params = SamplingParams(
        num_generations=args.G, max_completion_length=args.new_tokens, ignore_eos=True,
        max_prompt_length=None, length_bucket=args.length_bucket,
    )
    decoding.next_tokens = labelled(decoding.next_tokens, "##sampling")
    kv_cache.BucketedLayer.update = labelled(kv_cache.BucketedLayer.update, "##cache_update")
    head = model.get_output_embeddings()
    head.forward = labelled(head.forward, "##lm_head")
    first_decode = {}
    original_forward = engine.__class__.forward

    def forward(self, input_ids, *a, **k):
        if input_ids.shape[1] == 1 and "t" not in first_decode:
            first_decode["t"] = time.perf_counter()
            with record_function("##decode_start"):
                pass
        return original_forward(self, input_ids, *a, **k)

    engine.__class__.forward = forward
    generator = torch.Generator().manual_seed(0)
    engine.generate(prompts, params, generator)  # warm-up
    first_decode.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0, c0 = time.perf_counter(), time.process_time()
        batch = engine.generate(prompts, params, generator)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    events = prof.events()
    start = next(e.time_range.start for e in events if e.name == "##decode_start")
    cats = categorise(events, start)
    decode_ms = batch.timing["decode_s"] * 1e3
    steps = int(batch.timing["steps"])
    ops_ms = sum(cats.values())
    rows = args.prompts * args.G
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.model} ({n_params / 1e6:.1f}M params), {rows} rows, {steps} steps, "
        f"threads {args.threads}, load {os.getloadavg()[0]:.2f}; rollout wall {wall:.2f} s, CPU {cpu:.2f} s, "
        f"decode {decode_ms / 1e3:.2f} s = {decode_ms / steps:.1f} ms/step (profiled)"
    )
    print("| category | ms / step | share of decode |")
    print("|---|---:|---:|")
    for name in ("matmul: layers", "matmul: LM head", "attention (SDPA)", "sampling", "KV-cache writes", "other ops"):
        v = cats.get(name, 0.0)
        print(f"| {name} | {v / steps:.2f} | {v / decode_ms:.0%} |")
    rest = decode_ms - ops_ms
    print(f"| Python / dispatch / waiting (wall - ops) | {rest / steps:.2f} | {rest / decode_ms:.0%} |")
    if args.table:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
