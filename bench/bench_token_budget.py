"""Training-step time and memory with and without ``max_tokens_per_micro_batch``, side by side.

One fixed round of completions with long-tailed lengths (most short, about a quarter long, as a
reasoning task's) is trained on by the GRPO trainer's own optimizer steps, in fresh subprocesses
alternating the modes ``--repeats`` times:

* ``fixed``: micro-batches of ``--micro`` rows (``gradient_accumulation_steps`` of them per step),
* ``budget``: the same rows per step packed under a token budget equal to the worst fixed
  micro-batch (``--micro`` rows at the longest length: the same memory bound, less padding),
* ``half``: half that budget (a lower memory bound).

Each optimizer step reshuffles the round (seeded), so the long rows land in different fixed
micro-batches. Per step: wall and process CPU time of the training phase, the decoder tokens its
forwards ran (the cost model of grpo_ascend/trainers/micro_batches.py, for every mode), the
micro-batch count, and the training peak memory (the allocator's on an accelerator; on the CPU the
process's peak RSS since the step began, printed as the rise over the RSS before the first step).
The first step of each run is a warm-up and not counted. Examples::

    python bench/bench_token_budget.py                      # small model, CPU, 1 thread
    python bench/bench_token_budget.py --model builtin:tiny --steps 6
    python bench/bench_token_budget.py --device cuda --rows 64 --long 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("fixed", "budget", "half")


def fixed_round(args: argparse.Namespace, pad_token_id: int, device: Any) -> Any:
    """One round of ``args.rows`` completions in groups of 8, a quarter of them long."""
    import torch

    from grpo_ascend.experience import Experience

    g = torch.Generator().manual_seed(0)
    n, G = args.rows, 8
    prompt = torch.randint(5, 500, (n // G, args.prompt), generator=g).repeat_interleave(G, 0)
    long = torch.rand(n, generator=g) < 0.25
    lengths = torch.where(long, torch.randint(args.long // 2, args.long + 1, (n,), generator=g),
                          torch.randint(4, args.short + 1, (n,), generator=g))
    comp = torch.randint(5, 500, (n, args.long), generator=g)
    mask = (torch.arange(args.long) < lengths[:, None]).long()
    comp = torch.where(mask.bool(), comp, torch.full_like(comp, pad_token_id))
    rewards = torch.randn(n, generator=g)
    t = {k: v.to(device) for k, v in dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=comp,
                                           completion_mask=mask, loss_mask=mask.float()).items()}
    return Experience(**t, sampling_logps=torch.zeros(n, args.long, device=device),
                      truncated=torch.zeros(n, dtype=torch.bool, device=device), rewards=rewards.to(device),
                      rewards_per_function=rewards[:, None].to(device), reward_names=["fixed"],
                      group_ids=(torch.arange(n) // G).to(device), prompts=["p"] * n, completions=["c"] * n)


def worker(args: argparse.Namespace) -> None:
    import torch

    from grpo_ascend import GRPOConfig, GRPOTrainer
    from grpo_ascend import device as dev
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.models.policy import default_lora_config
    from grpo_ascend.trainers.micro_batches import TokenCost

    torch.set_num_threads(args.threads)
    accum = args.rows // args.micro
    worst = args.micro * (args.prompt + args.long)
    budget = {"fixed": None, "budget": worst, "half": worst // 2}[args.mode]
    cfg = GRPOConfig(output_dir=f"/tmp/bench_token_budget/{args.mode}", num_generations=8,
                     per_device_train_batch_size=args.micro, gradient_accumulation_steps=accum,
                     max_completion_length=args.long, max_prompt_length=args.prompt, beta=0.0, loss_type="dapo",
                     learning_rate=1e-5, lr_scheduler_type="constant", max_steps=args.steps, save_steps=0,
                     disable_tqdm=True, log_completions_steps=0, seed=0, device=args.device, length_bucket=1,
                     max_tokens_per_micro_batch=budget, bf16=args.device != "cpu")
    trainer = GRPOTrainer(args.model, lambda completions, **kw: [0.0] * len(completions), cfg,
                          arithmetic_dataset(64), peft_config=default_lora_config(r=16))
    exp = fixed_round(args, trainer.tokenizer.pad_token_id, trainer.device)
    trainer.experience.make = lambda *a, complete=None, **k: (dataclasses.replace(exp, **complete(exp)[0]), {})
    cost = TokenCost(args.prompt, args.long, share_prompts=cfg.share_prompt_prefill, length_bucket=1)
    lengths = exp.completion_mask.sum(1).tolist()
    step_tokens: list[int] = []
    original = trainer.training_step

    def recording(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:  # once per micro-batch
        ids = inputs.rows.tolist()
        step_tokens[-1] += cost(len(ids), len({i // 8 for i in ids}), max(lengths[i] for i in ids))
        return original(model, inputs, num_items_in_batch)

    trainer.training_step = recording
    trainer.begin_run()
    rss_before = dev.memory_stats(trainer.device)["allocated"] / 2**20
    steps = []
    while trainer.step < trainer.max_steps:
        step_tokens.append(0)
        cpu, wall = time.process_time(), time.perf_counter()
        trainer.train_round()
        rec = trainer.run.last_record
        steps.append({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                      "tokens": step_tokens[-1], "micro_batches": rec.get("micro_batches", float(accum)),
                      "peak_mb": rec["memory/peak_gb/training"] * 1024})
    print(json.dumps({"mode": args.mode, "budget": budget, "rss_before_mb": rss_before, "steps": steps}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="builtin:small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=32, help="completions per optimizer step (groups of 8)")
    p.add_argument("--micro", type=int, default=8, help="rows per fixed micro-batch")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is a warm-up)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import describe  # bench/machine.py: what the figures were measured on

    if args.mode:
        worker(args)
        return
    print(f"machine: {describe(args.threads)}", flush=True)
    print(f"load average {os.getloadavg()}; {args.model} on {args.device}, {args.threads} thread(s)", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ})
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[mode].append(result)
            timed = result["steps"][1:]
            print(f"repeat {r} {mode:6s} budget={result['budget']}: wall/step "
                  f"{statistics.median(s['wall'] for s in timed):.2f} s, cpu/step "
                  f"{statistics.median(s['cpu'] for s in timed):.2f} s, tokens/step "
                  f"{statistics.mean(s['tokens'] for s in timed):.0f}, micro-batches "
                  f"{[int(s['micro_batches']) for s in timed]}, training peak "
                  f"{max(s['peak_mb'] for s in timed):.0f} MB (RSS before {result['rss_before_mb']:.0f} MB)",
                  flush=True)
    print("\nmode    budget  tokens/step  wall/step (per-repeat medians)  cpu/step  peak MB")
    for mode in MODES:
        timed = [s for res in runs[mode] for s in res["steps"][1:]]
        walls = [statistics.median(s["wall"] for s in res["steps"][1:]) for res in runs[mode]]
        print(f"{mode:6s}  {runs[mode][0]['budget']!s:6s}  {statistics.mean(s['tokens'] for s in timed):11.0f}  "
              f"{', '.join(f'{w:.2f}' for w in walls):30s}  {statistics.median(s['cpu'] for s in timed):8.2f}  "
              f"{max(s['peak_mb'] for s in timed):7.0f}")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
