"""Randomness: seeding every generator, and capturing / restoring their states for checkpoints."""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from grpo_ascend.device.backends import (
    backend_module,
    cuda_available,
    device_index,
    device_type,
    is_accelerator,
)
from grpo_ascend.errors import ConfigError

logger = logging.getLogger(__name__)


def _loaded_npu() -> Any | None:
    """torch.npu if torch_npu is already imported (seeding must not trigger the import)."""
    if sys.modules.get("torch_npu") is None:
        return None
    return getattr(torch, "npu", None)


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy, torch (CPU) and every CUDA/NPU device for reproducible runs."""
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if cuda_available():
        torch.cuda.manual_seed_all(seed)
    npu = _loaded_npu()
    if npu is not None:
        npu.manual_seed_all(seed)


def rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """Capture python, numpy, torch CPU and (for an accelerator ``device``) its RNG state.

    The result holds only tensors and plain Python containers, so a checkpoint can be read back
    with ``torch.load(weights_only=True)``.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if device is not None and is_accelerator(device):
        kind_name = device_type(device)
        state["device_type"] = kind_name
        state["device"] = backend_module(kind_name).get_rng_state(device_index(device))
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device | str | None = None) -> None:
    """Restore a state from :func:`rng_state` so the next random draws are identical.

    The device part is restored only when ``device`` has the same type as the one captured
    (resuming an NPU run on a GPU restores the host RNGs and logs a warning).
    """
    missing = [key for key in ("python", "numpy", "torch") if key not in state]
    if missing:
        raise ConfigError(f"RNG state is missing {missing}; expected the dict returned by rng_state()")
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "device" not in state or device is None:
        return
    saved_type = state.get("device_type")
    if device_type(device) != saved_type:
        logger.warning(
            "RNG state was saved on %s but the run is on %s; device RNG not restored", saved_type, device_type(device)
        )
        return
    backend_module(saved_type).set_rng_state(state["device"], device_index(device))
