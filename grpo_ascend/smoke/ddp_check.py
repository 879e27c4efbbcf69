"""Smoke check: two-device data parallelism, as ``grpo-ascend train --num_processes 2`` launches it (accelerate,
the device's collective backend). Skipped with fewer than two devices."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import yaml

from grpo_ascend import device as dev
from grpo_ascend.smoke.context import BUILTIN_MODEL, SmokeContext
from grpo_ascend.smoke.report import CheckResult
from grpo_ascend.smoke.training_check import smoke_recipe

DDP_STEPS = 2


def check_ddp(ctx: SmokeContext) -> CheckResult:
    """``DDP_STEPS`` GRPO steps on the built-in model over two devices; both ranks must finish."""
    count = dev.device_count(ctx.device_type)
    if count < 2:
        return CheckResult("ddp", "skipped", f"{count} {ctx.device_type} device here",
                           reason="two-device DDP needs two devices (the test suite runs it on 2 CPU processes)")
    folder = ctx.out / "ddp"
    folder.mkdir(parents=True, exist_ok=True)
    recipe = {**smoke_recipe(ctx, BUILTIN_MODEL, str(folder / "run")), "max_steps": DDP_STEPS}
    recipe.pop("device")  # each rank takes the device of its LOCAL_RANK
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    command = [sys.executable, "-m", "grpo_ascend.cli", "--log-level", "warning", "train", str(path),
               "--num_processes", "2"]
    timeout = max(30.0, ctx.seconds_left())
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    (folder / "log.txt").write_text(done.stdout + done.stderr)
    metrics = Path(recipe["output_dir"]) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    losses = [float(r["loss"]) for r in records]
    numbers = {"exit_code": done.returncode, "steps": len(records), "losses": losses,
               "step_s": [float(r["time/step"]) for r in records], "log": str(folder / "log.txt")}
    summary = f"2 processes, {len(records)} of {DDP_STEPS} steps, exit code {done.returncode}"
    if done.returncode != 0 or len(records) != DDP_STEPS or not all(math.isfinite(x) for x in losses):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return CheckResult("ddp", "failed", summary, numbers, f"see {numbers['log']}: {tail[0]}")
    return CheckResult("ddp", "ok", summary, numbers)
