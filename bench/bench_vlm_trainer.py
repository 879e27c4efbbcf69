"""Vision-language GRPO step time and memory: grpo_ascend's GRPOTrainer vs TRL's GRPOTrainer, side by side.

Both trainers do the same work on the same offline model and data: the coloured-shapes task
(grpo_ascend/vision/shapes_task.py: one 28x28 picture and the same question per row, an ``image`` column, the
``colour`` column read by ``colour_code_reward``), LoRA r=16 / alpha=32 on the language model's linear layers
only (the same regex for both, so neither adapts the vision tower or projector), G=8 completions for each of 4
prompts per optimizer step (micro-batches of 8, 4 accumulation steps), completions forced to ``--new-tokens``
(ours: ``ignore_eos``; TRL's ``generate``: ``min_new_tokens``), temperature 1, beta=0.04, ``loss_type`` dapo,
fp32 on the CPU.

The model defaults to ``tiny-llava`` (bench/vlm_models.py): TRL loads a processor with ``AutoProcessor``, and
the Qwen2.5-VL processor needs torchvision, which does not install beside this torch (docs/vlm.md); with a
``*qwen2_5_vl*`` model both trainers get the image-only processor object as ``processing_class`` instead.

The run is bench_trainer.py's: each trainer in a fresh subprocess, the two taking turns one optimizer step at a
time (a baton over a pipe), the first step a warm-up, each step's wall and CPU time, a step uncontended when
CPU time >= 0.8 x threads x wall, peak RSS during ``train()``.

Examples::

    python bench/bench_vlm_trainer.py                        # tiny-llava, 2 threads, 1 warm-up + 3 steps, 2 repeats
    python bench/bench_vlm_trainer.py --model random-llava-32k --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trainer import IMPLS, StepClock, fmt_gib, measured_train, spawn_lockstep, uncontended  # noqa: E402
from vlm_models import MODELS, vlm_folder  # noqa: E402

#: The language model's linear layers (what ours calls all-linear on a vision-language model), for both trainers.
LANGUAGE_LINEARS = r".*\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@dataclass
class VLMSettings:
    """What both workers run with (passed to them as JSON)."""

    model: str = "tiny-llava"
    threads: int = 2
    isa: str = "native"
    prompts_per_step: int = 4
    num_generations: int = 8
    micro_batch: int = 8
    grad_accum: int = 4
    new_tokens: int = 32
    beta: float = 0.04
    loss_type: str = "dapo"
    learning_rate: float = 1e-5
    lora_r: int = 16
    lora_alpha: int = 32
    warmup_steps: int = 1
    steps: int = 3
    dataset_size: int = 64
    seed: int = 0


def lora_config(s: VLMSettings) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, lora_dropout=0.0, target_modules=LANGUAGE_LINEARS,
                      task_type="CAUSAL_LM")


def _setup(s: VLMSettings, impl: str) -> tuple[str, Any, Any]:
    """(model folder, dataset, processing_class or None) with the thread count and TRL's allocator set."""
    import torch

    from grpo_ascend.device import host_allocator
    from grpo_ascend.models.vision_language import load_processor
    from grpo_ascend.vision.shapes_task import coloured_shapes_dataset

    torch.set_num_threads(s.threads)
    if impl == "trl":  # glibc's adaptive mmap threshold, as TRL runs
        host_allocator.fix_mmap_threshold = lambda *args, **kwargs: None
    folder = vlm_folder(s.model)
    processor = load_processor(folder) if "qwen2_5_vl" in s.model else None  # AutoProcessor needs torchvision
    return str(folder), coloured_shapes_dataset(s.dataset_size, seed=s.seed), processor


def run_ours(s: VLMSettings, out_dir: Path) -> dict[str, Any]:
    import torch
    from machine import describe

    from grpo_ascend import GRPOConfig, GRPOTrainer
    from grpo_ascend.vision.shapes_task import colour_code_reward

    folder, ds, processor = _setup(s, "ours")
    cfg = GRPOConfig(
        output_dir=str(out_dir), device="cpu", seed=s.seed, max_steps=s.warmup_steps + s.steps,
        per_device_train_batch_size=s.micro_batch, gradient_accumulation_steps=s.grad_accum,
        num_generations=s.num_generations, max_completion_length=s.new_tokens, max_prompt_length=512,
        temperature=1.0, beta=s.beta, loss_type=s.loss_type, learning_rate=s.learning_rate, bf16=False,
        save_steps=0, log_completions_steps=0, disable_tqdm=True, report_to=[],
    )
    trainer = GRPOTrainer(model=folder, reward_funcs=[colour_code_reward], args=cfg, train_dataset=ds,
                          processing_class=processor, peft_config=lora_config(s))
    trainer.rollout.params.ignore_eos = True
    clock = StepClock(s.warmup_steps + s.steps)
    record_step = trainer.recorder.step

    def timed_record_step(*args: Any, **kwargs: Any) -> None:
        record_step(*args, **kwargs)
        clock.step_end()

    trainer.recorder.step = timed_record_step  # type: ignore[method-assign]
    result, warmup, gaps = measured_train(trainer, torch.device("cpu"), s, None, clock)  # type: ignore[arg-type]
    logs = [r for r in trainer.state.log_history if "loss" in r][s.warmup_steps:]
    result.update(warmup_s=warmup, step_s=gaps, threads=torch.get_num_threads(), machine=describe(),
                  completion_len=statistics.fmean(r["completion_length/mean"] for r in logs) if logs else float("nan"))
    return result


def run_trl(s: VLMSettings, out_dir: Path) -> dict[str, Any]:
    import torch
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_ascend.vision.shapes_task import colour_code_reward

    folder, ds, processor = _setup(s, "trl")
    clock = StepClock(s.warmup_steps + s.steps)

    class StepEnds(TrainerCallback):
        """Optimizer-step ends, to the step clock."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step_end()

    cfg = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, seed=s.seed, max_steps=s.warmup_steps + s.steps,
        per_device_train_batch_size=s.micro_batch, gradient_accumulation_steps=s.grad_accum,
        num_generations=s.num_generations, max_completion_length=s.new_tokens, temperature=1.0, top_p=1.0,
        top_k=0, beta=s.beta, loss_type=s.loss_type, learning_rate=s.learning_rate, bf16=False, fp16=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": torch.float32},
        generation_kwargs={"min_new_tokens": s.new_tokens}, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, dataloader_pin_memory=False, max_grad_norm=1.0,
        optim="adamw_torch",
    )
    trainer = GRPOTrainer(model=folder, reward_funcs=[colour_code_reward], args=cfg, train_dataset=ds,
                          processing_class=processor, peft_config=lora_config(s), callbacks=[StepEnds()])
    result, warmup, gaps = measured_train(trainer, torch.device("cpu"), s, None, clock)  # type: ignore[arg-type]
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r][s.warmup_steps:]
    result.update(warmup_s=warmup, step_s=gaps, threads=torch.get_num_threads(), trl_version=trl.__version__,
                  processor=type(trainer.processing_class).__name__,
                  completion_len=statistics.fmean(r["completions/mean_length"] for r in logs) if logs else float("nan"))
    return result


WORKERS = {"ours": run_ours, "trl": run_trl}


def report(s: VLMSettings, runs: dict[str, list[dict[str, Any]]]) -> None:
    """The summary table and the ratio ours/TRL."""
    wall = {i: statistics.median(t for r in runs[i] for t in r["step_s"]) for i in IMPLS}
    cpu = {i: statistics.median(t for r in runs[i] for t in r["cpu_step_s"]) for i in IMPLS}
    clean = {i: uncontended(runs[i], s.threads) for i in IMPLS}
    enough = all(len(clean[i]) >= 3 for i in IMPLS)
    headline = {i: statistics.median(clean[i]) if enough else wall[i] for i in IMPLS}
    mem = {i: max(r["peak_rss_train_mib"] for r in runs[i]) for i in IMPLS}
    print("\n| trainer | s/step, uncontended (median) | s/step, all (median) | s/step min | CPU s/step | "
          "peak RSS in train() GiB | completion tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i in IMPLS:
        name = "grpo_ascend" if i == "ours" else f"TRL {runs['trl'][0]['trl_version']}"
        total = sum(len(r["step_s"]) for r in runs[i])
        c = f"{statistics.median(clean[i]):.2f} ({len(clean[i])}/{total})" if clean[i] else "none"
        print(f"| {name} | {c} | {wall[i]:.2f} | {min(t for r in runs[i] for t in r['step_s']):.2f} | {cpu[i]:.2f} "
              f"| {fmt_gib(mem[i])} | {statistics.fmean(r['completion_len'] for r in runs[i]):.1f} |")
    basis = "uncontended-step medians" if enough else "all-step medians (fewer than 3 uncontended steps)"
    print(f"\nratio ours/TRL s/step: {headline['ours'] / headline['trl']:.3f} from {basis}; CPU time "
          f"{cpu['ours'] / cpu['trl']:.3f}; peak RSS ours/TRL {mem['ours'] / mem['trl']:.2f}; TRL's processor "
          f"{runs['trl'][0]['processor']}")
    print(f"machine: {runs['ours'][0]['machine']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llava", choices=MODELS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per run, after the warm-up")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--python", default=sys.executable, help="interpreter for the workers (needs trl)")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        s = VLMSettings(**json.loads(args.settings))
        with tempfile.TemporaryDirectory(prefix=f"bench-vlm-{args.worker}-") as tmp:
            Path(args.result).write_text(json.dumps(WORKERS[args.worker](s, Path(tmp))))
        return
    s = VLMSettings(model=args.model, threads=args.threads, steps=args.steps, new_tokens=args.new_tokens)
    vlm_folder(s.model)  # built once here, not in both workers at the same time
    print(f"VLM GRPO step, {s.model}, fp32 on cpu, {s.threads} thread(s): {s.prompts_per_step} prompts x "
          f"G={s.num_generations} per optimizer step ({s.grad_accum} micro-batches of {s.micro_batch}), one image "
          f"per prompt, {s.new_tokens} new tokens (fixed), beta={s.beta}, loss_type={s.loss_type}, LoRA r={s.lora_r} "
          f"on the language model; {s.warmup_steps} warm-up + {s.steps} timed steps, {args.repeats} run(s) each, "
          "taking turns step by step", flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vlm-trainer-"))
    runs: dict[str, list[dict[str, Any]]] = {i: [] for i in IMPLS}
    script = Path(__file__).resolve()
    for rep in range(args.repeats):
        load = os.getloadavg()[0]
        results = spawn_lockstep(s, args.python, log_dir, rep, script=script)  # type: ignore[arg-type]
        for i in IMPLS:
            runs[i].append(results[i])
            r = results[i]
            print(f"  [{i} run {rep + 1}] warm-up {r['warmup_s']:.2f} s, steps {', '.join(f'{t:.2f}' for t in r['step_s'])}"
                  f" s wall, {', '.join(f'{t:.2f}' for t in r['cpu_step_s'])} s CPU; load {load:.2f}", flush=True)
    report(s, runs)


if __name__ == "__main__":
    main()
