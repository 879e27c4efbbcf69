"""Rollouts ahead of training vs in lockstep, side by side in one script (docs/async.md).

Runs the same GRPO configuration (long completions, so that sampling and training take comparable
time) as: sync at 2 threads; sync at 1 thread (each side alone: its generation and training times);
one_step_off and async with the rollout process on 1 core and the trainer on the other (async with
partial_rollouts continue, the default, and abort: the token slots each throws away). Prints each
run's steady-state seconds per step (the first steps, start-up included, left out), each side's
idle fraction, the staleness, and the ratio asked of the overlap:
async step time / max(generation alone, training alone) at the same per-side thread count.

    python bench/bench_async.py                 # the built-in tiny model (warm start)
    python bench/bench_async.py --random-model  # random weights, another shape and a 32k vocabulary
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from machine import describe  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from grpo_ascend import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_ascend.data.synthetic import arithmetic_dataset  # noqa: E402
from grpo_ascend.models.policy import default_lora_config  # noqa: E402


def _reward(completions, **kwargs):
    return [float(len(c) % 7) for c in completions]


def _model(random_model: bool) -> str:
    if not random_model:
        return "builtin:tiny-warm"
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from grpo_ascend.models.tiny_model import build_tiny_model

    folder = tempfile.mkdtemp(prefix="bench-async-model-")
    tok = AutoTokenizer.from_pretrained(build_tiny_model("tiny"))
    config = Qwen2Config(vocab_size=32768, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run(model: str, mode: str, threads: int, steps: int, skip: int, partial: str = "continue") -> dict[str, float]:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, max_steps=steps, num_generations=8, per_device_train_batch_size=32,
            max_completion_length=96, max_prompt_length=64, learning_rate=1e-4, logging_steps=1, save_steps=0,
            disable_tqdm=True, log_completions_steps=0, seed=0, lr_scheduler_type="constant", rollout_mode=mode,
            max_staleness=2, rollout_threads=1 if mode != "sync" else None, partial_rollouts=partial,
        )
        trainer = GRPOTrainer(model, _reward, cfg, arithmetic_dataset(2000, seed=3),
                              peft_config=default_lora_config(r=8))
        trainer.rollout.params.ignore_eos = True  # every completion at full length: a steady load
        stamps: list[float] = []
        trainer.add_callback(_Stamps(stamps))
        trainer.train()
        logs = [r for r in trainer.state.log_history if "time/step" in r][skip:]
    per_step = (stamps[-1] - stamps[skip]) / (len(stamps) - 1 - skip)
    mean = lambda key: sum(r.get(key, 0.0) for r in logs) / len(logs)  # noqa: E731
    return {"s_per_step": per_step, "generation_s": mean("time/generation"), "training_s": mean("time/training"),
            "staleness_mean": mean("async/staleness_mean"), "producer_idle": mean("async/producer_idle_fraction"),
            "trainer_wait_s": mean("async/trainer_wait_s"), "aborted_tokens": mean("async/aborted_tokens"),
            "tokens": mean("tokens_generated")}


class _Stamps(TrainerCallback):
    """Records the wall clock at each step's end."""

    def __init__(self, stamps: list[float]) -> None:
        self.stamps = stamps

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random-model", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (start-up, the queue filling)")
    args = parser.parse_args()
    print(describe())
    model = _model(args.random_model)
    results = {
        "sync@2": run(model, "sync", 2, args.steps, args.skip),
        "sync@1": run(model, "sync", 1, args.steps, args.skip),
        "one_step_off@1+1": run(model, "one_step_off", 1, args.steps, args.skip),
        "async@1+1": run(model, "async", 1, args.steps, args.skip),
        "async-abort@1+1": run(model, "async", 1, args.steps, args.skip, partial="abort"),
    }
    alone = results["sync@1"]
    bound = max(alone["generation_s"], alone["training_s"])
    for name, r in results.items():
        print(f"{name:18s} {r['s_per_step']:.2f} s/step  gen {r['generation_s']:.2f}  train {r['training_s']:.2f}  "
              f"staleness {r['staleness_mean']:.2f}  producer idle {r['producer_idle']:.2f}  "
              f"trainer wait {r['trainer_wait_s']:.2f} s")
    print(f"generation alone {alone['generation_s']:.2f} s, training alone {alone['training_s']:.2f} s (1 thread each)")
    for name in ("one_step_off@1+1", "async@1+1"):
        print(f"{name}: step / max(generation alone, training alone) = {results[name]['s_per_step'] / bound:.2f}")
    for name in ("async@1+1", "async-abort@1+1"):
        r = results[name]
        print(f"{name}: token slots thrown away per step {r['aborted_tokens']:.0f} of {r['tokens']:.0f} kept")
    print(f"speed-up over sync@2: async {results['sync@2']['s_per_step'] / results['async@1+1']['s_per_step']:.2f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
