"""The README's main job at a smaller scale: the accuracy reward of the default recipe rises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_ascend.config.recipe import load_recipe
from grpo_ascend.run import build_trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_default_recipe_accuracy_rises(tmp_path):
    recipe, cfg = load_recipe(
        ROOT / "recipes" / "default.yaml",
        {"max_steps": 60, "output_dir": str(tmp_path / "run"), "save_steps": 0, "export_adapter_at_end": False,
         "disable_tqdm": True, "log_completions_steps": 0},
    )
    build_trainer(recipe, cfg).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    acc = [r["rewards/accuracy/mean"] for r in records]
    first, last = sum(acc[:15]) / 15, sum(acc[-15:]) / 15
    assert last > first + 0.05, (first, last)
