"""The memory plan (grpo_ascend/planning/memory_plan.py) against the peak memory a real run measures, per phase, on the CPU.

Each configuration trains 2 rounds (1 optimizer step each) of a random-weight Qwen2 of small hidden size
and a chosen vocabulary with the built-in tokenizer, and reads ``memory/peak_gb/<phase>`` from the
trainer's log. On the CPU that is the process's peak resident set in the phase (VmHWM, reset at each
phase), so the baseline -- the resident set just before the model is built, with every library
imported -- is subtracted. The plan gets the run's real prompt width (the longest prompt of the
dataset under the chat template) and is computed from the same config objects the run used.

    python bench/check_memory_plan.py                # every configuration, one process, a table
    python bench/check_memory_plan.py --only lora-long
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 2**30


@dataclass(frozen=True)
class Case:
    """One measured configuration: the model's vocabulary and the trainer settings that differ from the base."""

    name: str
    vocab: int
    use_peft: bool
    config: dict[str, Any] = field(default_factory=dict)
    #: Key/value heads and head width: 4 x 128 makes the KV cache and attention activations weigh (long cases).
    kv_heads: int = 2
    head_dim: int = 16


BASE = dict(num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=2,
            max_completion_length=32, max_prompt_length=64, logprob_chunk_size=128, learning_rate=1e-4,
            save_steps=0, log_completions_steps=0, disable_tqdm=True, report_to=[], bf16=False)

LONG = {"max_completion_length": 256}
CASES = [
    Case("lora-short", 32768, True),
    Case("lora-long-beta", 8192, True, {**LONG, "beta": 0.04}, kv_heads=4, head_dim=128),
    Case("full-short-beta", 32768, False, {"beta": 0.04}),
    Case("full-vocab152k", 151936, False, {"num_generations": 4, "per_device_train_batch_size": 4}),
    Case("lora-long-checkpointing", 8192, True, {**LONG, "gradient_checkpointing": True}, kv_heads=4, head_dim=128),
]


def _alternating_reward(completions, **kwargs):
    """0, 1, 0, 1, ... within every group: advantages are never all zero, whatever was sampled."""
    return [float(i % 2) for i in range(len(completions))]


def _model(case: Case, tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=case.vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=case.kv_heads, head_dim=case.head_dim,
                         tie_word_embeddings=True,
                         max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).float()


def _prompt_width(dataset: Any, tokenizer: Any) -> int:
    """The longest prompt in tokens under the chat template (the engine's prompt width on the CPU)."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in dataset["prompt"]]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def measure(case: Case, out_dir: str) -> dict[str, tuple[float, float]]:
    """{phase: (measured GiB above the baseline, planned GiB)} for one configuration."""
    from transformers import AutoTokenizer

    from grpo_ascend import device as dev
    from grpo_ascend.config.configs import GRPOConfig
    from grpo_ascend.config.recipe import RecipeConfig
    from grpo_ascend.data.prompts import load_prompt_dataset
    from grpo_ascend.distributed.memory_layout import plain_layout
    from grpo_ascend.models.policy import default_lora_config
    from grpo_ascend.models.tiny_model import build_tiny_model
    from grpo_ascend.planning.memory_plan import ModelShape, plan_memory, settings_from_config
    from grpo_ascend.trainers.grpo import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model("tiny"))
    dataset = load_prompt_dataset("synthetic:arithmetic", synthetic_kwargs={"n": 16})
    args = GRPOConfig(**{**BASE, **case.config, "output_dir": out_dir})
    recipe = RecipeConfig(use_peft=case.use_peft, lora_r=8)
    peft = default_lora_config(8, 16) if case.use_peft else None
    gc.collect()
    baseline = dev.memory_stats("cpu")["allocated"]
    model = _model(case, tokenizer)
    trainer = GRPOTrainer(model=model, reward_funcs=[_alternating_reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft)
    trainer.train()
    measured: dict[str, float] = {}
    for record in trainer.state.log_history:
        for key, value in record.items():
            if key.startswith("memory/peak_gb/"):
                phase = key.rsplit("/", 1)[1]
                measured[phase] = max(measured.get(phase, 0.0), value * GiB - baseline)
    shape = ModelShape.from_config(model.config.to_dict())
    settings = settings_from_config(recipe, args, "cpu", 1, _prompt_width(dataset, tokenizer))
    plan = plan_memory(shape, settings, plain_layout(1))
    del trainer, model
    gc.collect()
    return {phase: (measured[phase] / GiB, plan.phase_bytes(phase) / GiB) for phase in plan.phases if phase in measured}


#: Run once before any measured configuration: it imports what the first model build and training step
#: load lazily (transformers' Qwen2 code, kernels' first-use buffers: about 90 MB of resident memory here),
#: which would otherwise be charged to the first configuration measured.
WARM_UP = Case("warm-up", 1024, True, {"max_completion_length": 8, "max_steps": 1})


def warm_up() -> None:
    """Import and initialise everything a measurement touches, so its baseline already holds it."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        measure(WARM_UP, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object {case: {phase: [measured, planned]}}")
    ns = parser.parse_args()
    warm_up()
    if ns.json:
        results = {}
        for case in CASES:
            if not ns.only or case.name in ns.only:
                with tempfile.TemporaryDirectory() as out:
                    results[case.name] = measure(case, out)
        print("MEMORY_PLAN_CHECK " + json.dumps(results))
        return
    print("| configuration | phase | measured GiB | planned GiB | planned / measured |")
    print("|---|---|---|---|---|")
    for case in CASES:
        if ns.only and case.name not in ns.only:
            continue
        with tempfile.TemporaryDirectory() as out:
            for phase, (got, want) in measure(case, out).items():
                print(f"| {case.name} | {phase} | {got:.3f} | {want:.3f} | {want / got:.2f} |", flush=True)


if __name__ == "__main__":
    main()
