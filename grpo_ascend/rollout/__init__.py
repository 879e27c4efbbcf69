"""Rollout: grouped sampling of completions behind one backend seam.

The seam (``RolloutBackend``, ``RolloutSession``, ``PolicyWeights``, ``build_backend``,
``register_backend``; :mod:`grpo_ascend.rollout.backend`), the built-in ``RolloutEngine``,
``RolloutBatch`` and ``SamplingParams`` are re-exported lazily, so importing one submodule
(e.g. ``grpo_ascend.rollout.sampling``) does not pull in the others.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "RolloutEngine": "grpo_ascend.rollout.engine",
    "RolloutBatch": "grpo_ascend.rollout.backend",
    "RolloutBackend": "grpo_ascend.rollout.backend",
    "RolloutSession": "grpo_ascend.rollout.backend",
    "PolicyWeights": "grpo_ascend.rollout.backend",
    "build_backend": "grpo_ascend.rollout.backend",
    "register_backend": "grpo_ascend.rollout.backend",
    "SamplingParams": "grpo_ascend.rollout.sampling",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
