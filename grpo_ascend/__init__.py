"""grpo-ascend: GRPO and PPO fine-tuning of causal LMs, Ascend NPU first, CUDA and CPU unchanged.

Heavy modules load lazily so that ``import grpo_ascend`` stays cheap and never loads the Ascend torch extension.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "GRPOConfig": "grpo_ascend.config.configs",
    "PPOConfig": "grpo_ascend.config.configs",
    "RecipeConfig": "grpo_ascend.config.recipe",
    "GRPOTrainer": "grpo_ascend.trainers.grpo",
    "PPOTrainer": "grpo_ascend.trainers.ppo",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grpo_ascend' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
