"""Rollout throughput: grpo_ascend's RolloutEngine vs Hugging Face ``model.generate``, side by side.

Both sample G completions for each of P prompts (~128 tokens) with the same model, the same
sampling distribution (T = 1, no top-k/top-p) and the same stopping rule, interleaved
(ours, generate, ours, generate, ...) after one warm-up each; the table reports medians.
Throughput counts generated tokens up to and including the first stop token of each completion.

Two modes:

* ``eos-off``: every completion runs to ``--new-tokens`` (ours: ``ignore_eos=True``; generate:
  no EOS id);
* ``natural``: completions stop at EOS or at any of a fixed random set of extra token ids, the
  same set for both engines (generate gets it as its list of EOS ids). The models here are
  random-init with nearly flat next-token distributions, so they would almost never emit EOS by
  themselves; a stop set covering ``--stop-prob`` of the vocabulary (default 1.8 %) gives a
  realistic spread of completion lengths (mean ~50 tokens, about one in ten reaching the limit).

Each call's wall time and process CPU time are recorded (other jobs on a shared machine show as
wall time well above CPU time × threads); the table gives medians and per-repeat ranges, and the
load average before and after.

``--vllm`` adds vLLM's in-process engine (grpo_ascend.rollout.vllm, the colocated backend) on the
same weights, loaded from the model's folder (a model built in memory is saved to a temporary one);
its KV cache is sized by ``--vllm-kv-mib``. vLLM reports tokens through its own sampler, so the
count is the same rule (up to and including the first stop token).

``--plain-cache`` adds a third engine, ours with the plain KV cache (``shared_prefix=False``: every
completion holds and reads its own copy of the prompt), so one run shows what the shared-prefix
decode attention (``rollout/shared_prefix.py``, the CPU default) gains.

Peak memory: on an accelerator, the allocator's peak minus what was allocated before the call;
on the CPU, the peak resident set size (VmHWM, reset before each call) minus RSS before the call.

Examples::

    python bench/bench_rollout.py                                   # CPU, fp32, `small` model
    python bench/bench_rollout.py --device cuda --dtype bf16 --model-config qwen2-0.5b
    python bench/bench_rollout.py --model-config qwen2.5-0.5b-2l --prompts 2   # bench_real_shape's model
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_ascend import device as devmod  # noqa: E402
from grpo_ascend.models.tiny_model import build_tiny_model  # noqa: E402
from grpo_ascend.models.tiny_tokenizer import WORDS  # noqa: E402
from grpo_ascend.rollout.engine import RolloutEngine  # noqa: E402
from grpo_ascend.rollout.sampling import SamplingParams  # noqa: E402
from grpo_ascend.rollout.vllm import VLLMColocatedRollout  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model(name: str, dtype: torch.dtype, dev: torch.device):
    """The offline model (tiny/small), a random-init Qwen2-0.5B-shaped model, bench_real_shape's
    ``qwen2.5-0.5b-<n>l`` (Qwen2.5-0.5B's shapes with n layers) or bench_random_model's
    ``random-25m``, with the tiny tokenizer."""
    from bench_random_model import RANDOM_MODELS
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if name.startswith("qwen2.5-0.5b-") or name in RANDOM_MODELS:
        from bench_random_model import build_random_model
        from bench_real_shape import build_real_shape_model

        path = build_real_shape_model(name) if name.startswith("qwen2.5-0.5b-") else build_random_model(name)
        model = AutoModelForCausalLM.from_pretrained(path).to(device=dev, dtype=dtype).eval()
        return model, AutoTokenizer.from_pretrained(path)
    tok_dir = build_tiny_model("small" if name == "qwen2-0.5b" else name)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if name == "qwen2-0.5b":
        config = Qwen2Config(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(0)
        with torch.device(dev):
            model = Qwen2ForCausalLM(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    else:
        model = AutoModelForCausalLM.from_pretrained(tok_dir)
    model.to(device=dev, dtype=dtype).eval()
    return model, tokenizer


def make_prompts(tokenizer, n: int, length: int, seed: int = 0) -> list[str]:
    """n word-soup prompts of between length - length//8 and length tokens (different lengths)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        target = length - (i * length // 8) // max(1, n - 1) if n > 1 else length
        words: list[str] = []
        while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < target:
            words.append(rng.choice(WORDS))
        while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) > target:
            words.pop()
        prompts.append(" ".join(words))
    return prompts


def count_tokens(completions: torch.Tensor, stops: list[int]) -> int:
    """Tokens up to and including the first stop id of each row (all of them when none)."""
    if not stops:
        return completions.numel()
    is_stop = torch.isin(completions, torch.tensor(stops, device=completions.device))
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, completions.shape[1])
    return int(first.sum())


def memory_before(dev: torch.device) -> int:
    devmod.synchronize(dev)
    devmod.reset_peak_memory(dev)
    return devmod.memory_stats(dev)["allocated"]


def run_ours(engine, prompts, params, dev, seed):
    base = memory_before(dev)
    t0, c0 = time.perf_counter(), time.process_time()
    batch = engine.generate(prompts, params, generator=torch.Generator(device=dev).manual_seed(seed))
    devmod.synchronize(dev)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = devmod.memory_stats(dev)["peak"] - base
    return int(batch.completion_lengths.sum()), elapsed, peak, cpu


def vllm_engine(model, tokenizer, args, dev):
    """The colocated vLLM backend on ``model``'s weights (saved to a temporary folder first)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="bench-vllm-")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return VLLMColocatedRollout(folder, tokenizer, SamplingParams(), device=dev,
                                dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype],
                                kv_cache_memory_bytes=args.vllm_kv_mib * 2**20,
                                max_model_length=args.prompt_len + args.new_tokens + 64)


def run_generate(model, tokenizer, prompts, args, stops, dev, seed):
    enc = tokenizer(
        prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt"
    ).to(dev)
    gen_config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    gen_config.eos_token_id = stops or None
    gen_config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    base = memory_before(dev)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            **enc,
            generation_config=gen_config,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=args.G,
            max_new_tokens=args.new_tokens,
        )
    devmod.synchronize(dev)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = devmod.memory_stats(dev)["peak"] - base
    return count_tokens(out[:, enc["input_ids"].shape[1] :], stops), elapsed, peak, cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="auto, cpu, or an accelerator name (default cpu)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--model-config", default="small",
                        help="tiny, small, qwen2-0.5b, random-25m(-v4k) or qwen2.5-0.5b-<n>l")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per engine and mode (after a warm-up)"
    )
    parser.add_argument("--modes", default="eos-off,natural")
    parser.add_argument(
        "--stop-prob",
        type=float,
        default=0.018,
        help="fraction of the vocabulary that stops a completion (natural)",
    )
    parser.add_argument("--length-bucket", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--vllm", action="store_true", help="also time vLLM's in-process engine (needs vLLM)")
    parser.add_argument("--vllm-kv-mib", type=int, default=256, help="vLLM's KV cache in MiB (with --vllm)")
    parser.add_argument("--plain-cache", action="store_true",
                        help="also time our engine with the plain KV cache (shared_prefix=False)")
    args = parser.parse_args(argv)
    from bench_random_model import RANDOM_MODELS
    from machine import describe

    if args.model_config not in ("tiny", "small", "qwen2-0.5b", *RANDOM_MODELS) \
            and not args.model_config.startswith("qwen2.5-0.5b-"):
        raise SystemExit(f"unknown --model-config {args.model_config!r}: tiny, small, qwen2-0.5b, "
                         f"{', '.join(RANDOM_MODELS)} or qwen2.5-0.5b-<n>l")

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = devmod.resolve_device(args.device)
    model, tokenizer = load_model(args.model_config, DTYPES[args.dtype], dev)
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_len)
    lens = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {args.model_config} ({n_params / 1e6:.1f}M params, {args.dtype}) on {dev}, "
        f"torch threads {torch.get_num_threads()}; {args.prompts} prompts of {min(lens)}-{max(lens)} tokens, "
        f"G={args.G}, {args.new_tokens} new tokens, {args.repeats} interleaved repeats after a warm-up; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"machine: {describe()}")
    engine = RolloutEngine(model, tokenizer)
    eos = engine.eos_token_ids
    rng = random.Random(1)
    special = set(tokenizer.all_special_ids)
    vocab = model.config.vocab_size
    extra = rng.sample([i for i in range(vocab) if i not in special], max(1, round(args.stop_prob * vocab)))

    engines = ["ours", "ours-plain", "generate"] if args.plain_cache else ["ours", "generate"]
    engines_by_name = {"ours": engine, "ours-plain": engine}
    if args.vllm:
        engines.insert(-1, "vllm")
        engines_by_name["vllm"] = vllm_engine(model, tokenizer, args, dev)
    rows = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in ("eos-off", "natural"):
            raise SystemExit(f"unknown mode {mode!r}: expected eos-off and/or natural")
        natural = mode == "natural"
        stops = (eos + extra) if natural else []
        params = SamplingParams(
            num_generations=args.G,
            max_completion_length=args.new_tokens,
            temperature=1.0,
            stop_token_ids=extra if natural else (),
            ignore_eos=not natural,
            max_prompt_length=None,
            length_bucket=args.length_bucket,
        )
        results: dict[str, list[tuple[int, float, int, float]]] = {name: [] for name in engines}
        for rep in range(args.repeats + 1):
            timed = {}
            for name in engines:
                if name == "generate":
                    timed[name] = run_generate(model, tokenizer, prompts, args, stops, dev, seed=rep)
                else:
                    own = replace(params, shared_prefix=False) if name == "ours-plain" else params
                    timed[name] = run_ours(engines_by_name[name], prompts, own, dev, seed=rep)
            if rep:  # the first round is a warm-up
                for name, run in timed.items():
                    results[name].append(run)
            shown = "  ".join(f"{name} {r[0] / r[1]:8.1f} tok/s ({r[1]:.2f} s, CPU {r[3]:.2f} s)"
                              for name, r in timed.items())
            print(f"  [{mode} {'warm-up' if rep == 0 else f'run {rep}'}] {shown}  load {os.getloadavg()[0]:.2f}",
                  flush=True)
        summary = {}
        for name, runs in results.items():
            tps = [r[0] / r[1] for r in runs]
            summary[name] = (
                statistics.median(tps),
                (min(tps), max(tps)),
                statistics.median(r[1] for r in runs),
                statistics.median(r[3] for r in runs),
                statistics.median(r[0] for r in runs),
                max(r[2] for r in runs),
            )
        ratios, cpu_ratios = {}, {}
        for name in engines[:-1]:
            pairs = list(zip(results[name], results["generate"]))
            ratios[name] = [o[0] / o[1] / (g[0] / g[1]) for o, g in pairs]
            cpu_ratios[name] = [o[0] / o[3] / (g[0] / g[3]) for o, g in pairs]
        rows.append((mode, summary, ratios, cpu_ratios))
        if args.plain_cache:
            gain = [o[1] / p[1] for o, p in zip(results["ours-plain"], results["ours"])]
            print(f"  [{mode}] shared-prefix vs plain cache, time per call plain/shared: median "
                  f"{statistics.median(gain):.2f}x ({min(gain):.2f}-{max(gain):.2f})")

    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    print(
        "| mode | engine | tokens/s median (range) | s/call | CPU s/call | tokens/call | peak mem (MiB) "
        "| ours/generate tokens/s, median (range) | by CPU time |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, summary, ratios, cpu_ratios in rows:
        for name in engines:
            tps, (lo, hi), sec, cpu, toks, peak = summary[name]
            r = c = ""
            if name in ratios:
                r = f"{statistics.median(ratios[name]):.2f}x ({min(ratios[name]):.2f}-{max(ratios[name]):.2f})"
                c = f"{statistics.median(cpu_ratios[name]):.2f}x"
            print(
                f"| {mode} | {name} | {tps:.1f} ({lo:.1f}-{hi:.1f}) | {sec:.2f} | {cpu:.2f} | {toks:.0f} "
                f"| {peak / 2**20:.0f} | {r} | {c} |"
            )


if __name__ == "__main__":
    main()
