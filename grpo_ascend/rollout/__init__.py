"""Rollout: grouped sampling of completions and the on-device rollout buffer.

``RolloutEngine``, ``RolloutBatch`` and ``SamplingParams`` are re-exported lazily, so importing
``grpo_ascend.rl.buffer`` does not pull in transformers.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "RolloutEngine": "grpo_ascend.rollout.engine",
    "RolloutBatch": "grpo_ascend.rollout.engine",
    "SamplingParams": "grpo_ascend.rollout.sampling",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
