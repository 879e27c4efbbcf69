"""The memory plan (grpo_ascend/planning/memory_plan.py) against the peak memory a real run measures, per phase, on the CPU.

Each configuration trains 2 rounds (1 optimizer step each) of a random-weight Qwen2 of small hidden size
and a chosen vocabulary with the built-in tokenizer, and reads ``memory/peak_gb/<phase>`` from the
trainer's log. On the CPU that is the process's peak resident set in the phase (VmHWM, reset at each
phase), so the baseline -- the resident set just before the model is built, with every library
imported -- is subtracted. The plan gets the run's real prompt width (the longest prompt of the
dataset under the chat template) and is computed from the same config objects the run used.
``lora-zero3-2proc`` runs on 2 ranks under DeepSpeed ZeRO-3, one process each, and gives one row per
rank (:func:`launch_ranks`).

    python bench/check_memory_plan.py                # every configuration, a table
    python bench/check_memory_plan.py --only lora-long-beta
    python bench/check_memory_plan.py --only lora-zero3-2proc   # needs deepspeed
"""

from __future__ import annotations

import argparse
import dataclasses
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
    hidden: int = 64
    tied: bool = True
    #: Processes; more than one runs DeepSpeed ZeRO-3 over gloo, one rank per process (see :func:`launch_ranks`).
    processes: int = 1


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
    # Untied 65,536 x 128 embedding and head, 64 of the model's 65 MiB: ZeRO-3's shard and gathered copies weigh.
    Case("lora-zero3-2proc", 65536, True, {"beta": 0.04, "logprob_chunk_size": 32}, hidden=128, tied=False,
         processes=2),
]


def _alternating_reward(completions, **kwargs):
    """0, 1, 0, 1, ... within every group: advantages are never all zero, whatever was sampled."""
    return [float(i % 2) for i in range(len(completions))]


def _model(case: Case, tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=case.vocab, hidden_size=case.hidden, intermediate_size=4 * case.hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=case.kv_heads,
                         head_dim=case.head_dim, tie_word_embeddings=case.tied,
                         max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).float()


def _prompt_width(dataset: Any, tokenizer: Any) -> int:
    """The longest prompt in tokens under the chat template (the engine's prompt width on the CPU)."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in dataset["prompt"]]
    return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def measure(case: Case, out_dir: str, model_dir: str | None = None) -> dict[str, tuple[float, float]]:
    """{phase: (measured GiB above the baseline, planned GiB)} for one configuration in this process (one rank
    of it when ``case.processes`` > 1: then the model is read from ``model_dir``, see :func:`launch_ranks`)."""
    from transformers import AutoTokenizer

    from grpo_ascend import device as dev
    from grpo_ascend.config.configs import GRPOConfig
    from grpo_ascend.config.recipe import RecipeConfig
    from grpo_ascend.data.prompts import load_prompt_dataset
    from grpo_ascend.distributed.memory_layout import deepspeed_layout, plain_layout
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
    model = model_dir if model_dir is not None else _model(case, tokenizer)
    trainer = GRPOTrainer(model=model, reward_funcs=[_alternating_reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft)
    trainer.train()
    measured: dict[str, float] = {}
    for record in trainer.state.log_history:
        for key, value in record.items():
            if key.startswith("memory/peak_gb/"):
                phase = key.rsplit("/", 1)[1]
                measured[phase] = max(measured.get(phase, 0.0), value * GiB - baseline)
    world = trainer.accelerator.num_processes
    shape = ModelShape.from_config(trainer.policy.config.to_dict())
    settings = settings_from_config(recipe, args, "cpu", world, _prompt_width(dataset, tokenizer))
    plan = plan_memory(shape, settings, deepspeed_layout(3, world) if case.processes > 1 else plain_layout(1))
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


def launch_ranks(case: Case, out: str, timeout: float = 600) -> list[dict[str, tuple[float, float]]]:
    """Measure ``case`` on ``case.processes`` ranks, one process each, under DeepSpeed ZeRO-3 as
    recipes/accelerate/deepspeed_zero3.yaml launches it (the environment ``accelerate launch`` sets; the
    model loads partitioned, zero3_init_flag) over gloo on loopback; one result per rank.

    A process's resident set is its rank's memory alone (gloo exchanges over sockets, no shared tensors),
    so each rank measures itself as a single process does, after its own warm-up run under ZeRO-3.
    """
    import socket
    import subprocess

    from transformers import AutoTokenizer

    from grpo_ascend.models.tiny_model import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model("tiny"))
    for model_case in (WARM_UP, case):  # saved once here, read by every rank
        _model(model_case, tokenizer).save_pretrained(Path(out) / model_case.name)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
           "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_MIXED_PRECISION": "no",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(case.processes),
           "LOCAL_WORLD_SIZE": str(case.processes), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    logs = [Path(out) / f"rank{rank}.log" for rank in range(case.processes)]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", case.name, "--dir", out],
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
             for rank, log in enumerate(logs)]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0] * case.processes:
        tails = "\n".join(f"--- rank {r} ---\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
        raise SystemExit(f"{case.name}: ranks exited with {codes or 'a timeout'}\n{tails}")
    return [json.loads((Path(out) / f"rank{rank}.json").read_text()) for rank in range(case.processes)]


def run_rank(name: str, out: str) -> None:
    """One rank of :func:`launch_ranks`: a warm-up run, then the measurement, written to ``out/rank<R>.json``."""
    import torch

    case = next(c for c in CASES if c.name == name)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    measure(dataclasses.replace(WARM_UP, processes=case.processes), str(Path(out) / "warm-up-run"),
            model_dir=str(Path(out) / WARM_UP.name))
    result = measure(case, str(Path(out) / "run"), model_dir=str(Path(out) / case.name))
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def results_of(case: Case) -> dict[str, dict[str, tuple[float, float]]]:
    """{row: {phase: (measured, planned)}}: one row for a single process, one per rank (``name/rank<R>``) else."""
    with tempfile.TemporaryDirectory() as out:
        if case.processes == 1:
            return {case.name: measure(case, out)}
        return {f"{case.name}/rank{rank}": phases for rank, phases in enumerate(launch_ranks(case, out))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object {row: {phase: [measured, planned]}}")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # a rank started by launch_ranks
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.rank_of:
        run_rank(ns.rank_of, ns.dir)
        return
    cases = [case for case in CASES if not ns.only or case.name in ns.only]
    if any(case.processes == 1 for case in cases):
        warm_up()
    if ns.json:
        results = {}
        for case in cases:
            results.update(results_of(case))
        print("MEMORY_PLAN_CHECK " + json.dumps(results))
        return
    print("| configuration | phase | measured GiB | planned GiB | planned / measured |")
    print("|---|---|---|---|---|")
    for case in cases:
        for row, phases in results_of(case).items():
            for phase, (got, want) in phases.items():
                print(f"| {row} | {phase} | {got:.3f} | {want:.3f} | {want / got:.2f} |", flush=True)


if __name__ == "__main__":
    main()
