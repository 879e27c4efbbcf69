"""Configuration and TRL compatibility: the config dataclasses (TRL's field names and meanings), their
validation and generated reference, YAML recipes, and the mapping of every TRL ``GRPOConfig`` field.

``from grpo_ascend.config import GRPOConfig`` works as before; the classes load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "BaseRLConfig": "grpo_ascend.config.base_config",
    "BatchPlan": "grpo_ascend.config.base_config",
    "GRPOConfig": "grpo_ascend.config.configs",
    "PPOConfig": "grpo_ascend.config.configs",
    "RecipeConfig": "grpo_ascend.config.recipe",
    "load_recipe": "grpo_ascend.config.recipe",
    "parse_overrides": "grpo_ascend.config.recipe",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
