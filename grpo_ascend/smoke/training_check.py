"""Smoke check: a few GRPO steps with LoRA on one model, and its measured peak memory beside ``grpo-ascend plan``'s.

The run is what ``grpo-ascend train`` builds from a recipe (the built-in arithmetic task, ``accuracy`` +
``format`` rewards), small enough for a minute on a CPU. It fails when a loss is not finite or a step did
not happen; the reward, step time and memory are reported, not judged (a model that has never seen the
task may score 0).
"""

from __future__ import annotations

import math
from typing import Any

from grpo_ascend.config.recipe import load_recipe
from grpo_ascend.distributed.memory_layout import plain_layout
from grpo_ascend.planning.memory_plan import GiB, load_model_shape, plan_memory, settings_from_config
from grpo_ascend.run import build_trainer
from grpo_ascend.smoke.context import BUILTIN_MODEL, DATASET, DATASET_KWARGS, SmokeContext
from grpo_ascend.smoke.report import CheckResult


def smoke_recipe(ctx: SmokeContext, model: str, folder: str) -> dict[str, Any]:
    """The recipe values of a smoke training run of ``model`` writing to ``folder``."""
    return {
        "model": model, "model_dtype": "float32", "dataset": DATASET, "dataset_kwargs": dict(DATASET_KWARGS),
        "reward_funcs": ["accuracy", {"name": "format", "pattern": r"^<answer>-?\d+</answer>$"}],
        "reward_weights": [1.0, 0.1], "use_peft": True, "lora_r": 8, "lora_alpha": 16,
        "num_generations": 4, "per_device_train_batch_size": 8, "max_prompt_length": 256,
        "prompt_truncation": "left", "max_completion_length": 12, "learning_rate": 3e-4,
        "lr_scheduler_type": "constant", "loss_type": "dapo", "beta": 0.0, "max_steps": ctx.steps,
        "save_steps": 0, "logging_steps": 1, "log_completions_steps": 0, "export_adapter_at_end": False,
        "disable_tqdm": True, "output_dir": folder, "device": str(ctx.device),
        "bf16": ctx.dtype == "bfloat16", "seed": 0,
    }


def _planned_peak(recipe: Any, args: Any, ctx: SmokeContext) -> float | None:
    """The memory plan's peak in GiB for this run (None when the model's shape cannot be read)."""
    try:
        shape = load_model_shape(recipe.model)
    except Exception:  # a model whose config the planner does not read: report, do not fail
        return None
    settings = settings_from_config(recipe, args, ctx.device_type, 1)
    return plan_memory(shape, settings, plain_layout(1), None).peak_bytes / GiB


def check_training(ctx: SmokeContext, model: str, name: str) -> CheckResult:
    """``ctx.steps`` GRPO steps with LoRA on ``model``: rewards, finite losses, step time, peak vs plan."""
    recipe, args = load_recipe(None, smoke_recipe(ctx, model, str(ctx.out / name)))
    planned = _planned_peak(recipe, args, ctx)
    trainer = build_trainer(recipe, args)
    trainer.train()
    history = trainer.tracker.history
    losses = [float(r["loss"]) for r in history]
    step_times = sorted(float(r["time/step"]) for r in history)
    peak = max((float(r.get("memory/peak_gb", 0.0)) for r in history), default=0.0)
    numbers = {
        "model": model, "steps": len(history), "losses": losses, "rewards": [float(r["reward"]) for r in history],
        "median_step_s": step_times[len(step_times) // 2] if step_times else None,
        "peak_memory_gib": peak, "planned_peak_gib": planned,
        "peak_over_plan": peak / planned if planned else None, "device": str(ctx.device), "dtype": ctx.dtype,
    }
    summary = (f"{len(history)} steps, reward {numbers['rewards'][0] if history else float('nan'):.2f} -> "
               f"{numbers['rewards'][-1] if history else float('nan'):.2f}, median step "
               f"{numbers['median_step_s'] or 0:.2f} s, peak {peak:.2f} GiB"
               + (f" (plan {planned:.2f} GiB)" if planned else ""))
    if len(history) != ctx.steps:
        return CheckResult(name, "failed", summary, numbers, f"{len(history)} of {ctx.steps} steps ran")
    if not all(math.isfinite(loss) for loss in losses):
        return CheckResult(name, "failed", summary, numbers, "a loss is not finite")
    return CheckResult(name, "ok", summary, numbers)


def check_builtin_training(ctx: SmokeContext) -> CheckResult:
    """GRPO steps on the built-in model."""
    return check_training(ctx, BUILTIN_MODEL, "train_builtin")


def check_user_training(ctx: SmokeContext) -> CheckResult:
    """GRPO steps on the model the user named (``--model``), skipped without one."""
    if ctx.model is None:
        return CheckResult("train_model", "skipped", "no --model given", reason="pass --model PATH to train yours too")
    return check_training(ctx, ctx.model, "train_model")
