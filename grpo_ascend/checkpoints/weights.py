"""The trainable weights inside a checkpoint folder: how they are laid out, written and read back.

A LoRA model (``kind: lora`` in the manifest) is stored in PEFT's own layout: the top-level
adapter as ``adapter_config.json`` + ``adapter_model.safetensors`` in the folder itself (so the
folder loads with ``PeftModel.from_pretrained(base, CHECKPOINT)``), every other adapter in a
subfolder named after it, and trainable tensors outside any adapter (a PPO value head) in
``extra_trainable.safetensors``. A fully fine-tuned model (``kind: full``) stores its trainable
parameters by name in ``model.safetensors``. Export reads checkpoints through
:func:`read_top_adapter`, :func:`read_extra_trainable` and :func:`read_full_weights`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.checkpoints import files as io
from grpo_ascend.checkpoints.adapters import (
    adapter_config_dict,
    adapter_names,
    adapter_state_dict,
    check_adapter_config,
    check_tensors,
    copy_tensors_into,
    load_adapter_state_dict,
    named_trainable_parameters,
    non_adapter_trainable,
)
from grpo_ascend.errors import CheckpointError
from grpo_ascend.models.wrappers import is_peft

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
FULL_WEIGHTS_NAME = "model.safetensors"
EXTRA_TRAINABLE_NAME = "extra_trainable.safetensors"

_FIX = "Resume with the same base model and LoRA settings the checkpoint was written with."


def write_weights(
    model: torch.nn.Module, folder: Path, weights: Mapping[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """Write the trainable weights of an unwrapped ``model`` into ``folder``; returns the manifest fields.

    ``weights``: the trainable parameters by name, given when the model's own are sharded.
    """
    if is_peft(model):
        adapters = {}
        for index, adapter in enumerate(adapter_names(model)):
            sub = "" if index == 0 else adapter
            target = folder / sub if sub else folder
            target.mkdir(parents=True, exist_ok=True)
            io.save_tensors(target / ADAPTER_WEIGHTS_NAME, adapter_state_dict(model, adapter, weights))
            io.write_json(target / ADAPTER_CONFIG_NAME, adapter_config_dict(model, adapter), "the adapter config")
            adapters[adapter] = sub
        extra = non_adapter_trainable(model, weights)
        if extra:
            io.save_tensors(folder / EXTRA_TRAINABLE_NAME, extra)
        base = model.get_base_model()
        return {
            "kind": "lora",
            "adapters": adapters,
            "base_model_name_or_path": getattr(base, "name_or_path", None) or None,
        }
    params = dict(weights) if weights is not None else named_trainable_parameters(model)
    if not params:
        raise CheckpointError(
            "the model has no trainable parameters (every requires_grad is False); nothing to checkpoint. "
            "Unfreeze the parameters you train, or wrap the model with a LoRA adapter"
        )
    io.save_tensors(folder / FULL_WEIGHTS_NAME, params)
    return {"kind": "full", "adapters": {}, "base_model_name_or_path": getattr(model, "name_or_path", None) or None}


def read_top_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Config and weights of a LoRA checkpoint's top-level (active) adapter."""
    return io.read_json(folder / ADAPTER_CONFIG_NAME), io.load_tensors(folder / ADAPTER_WEIGHTS_NAME)


def read_extra_trainable(folder: Path, manifest: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The trainable tensors outside any adapter that a LoRA checkpoint holds (often none)."""
    return io.load_tensors(folder / EXTRA_TRAINABLE_NAME) if EXTRA_TRAINABLE_NAME in manifest["files"] else {}


def read_full_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The trainable parameters by name of a full fine-tuning checkpoint."""
    return io.load_tensors(folder / FULL_WEIGHTS_NAME)


def _prepare_adapters(model: torch.nn.Module, folder: Path, manifest: Mapping[str, Any]) -> Callable[[], None]:
    if manifest.get("kind") != "lora":
        raise CheckpointError(
            f"{folder} holds full-model weights ({FULL_WEIGHTS_NAME}) but the model is a LoRA PeftModel; "
            f"resume with full fine-tuning (no peft_config), or pick a LoRA checkpoint"
        )
    saved_adapters: dict[str, str] = dict(manifest.get("adapters") or {})
    model_adapters = adapter_names(model)
    if sorted(saved_adapters) != sorted(model_adapters):
        raise CheckpointError(
            f"{folder} holds adapters {sorted(saved_adapters)} but the model has {sorted(model_adapters)}; {_FIX}"
        )
    staged: list[tuple[str, Path, dict[str, torch.Tensor]]] = []
    for adapter in model_adapters:
        sub = saved_adapters[adapter]
        target = folder / sub if sub else folder
        check_adapter_config(io.read_json(target / ADAPTER_CONFIG_NAME), model, adapter, target / ADAPTER_CONFIG_NAME)
        weights_path = target / ADAPTER_WEIGHTS_NAME
        loaded = io.load_tensors(weights_path)
        check_tensors(loaded, adapter_state_dict(model, adapter), weights_path, _FIX)
        staged.append((adapter, weights_path, loaded))
    extra = non_adapter_trainable(model)
    extra_path = folder / EXTRA_TRAINABLE_NAME
    extra_loaded: dict[str, torch.Tensor] = {}
    if extra or extra_path.exists():
        extra_loaded = io.load_tensors(extra_path) if extra_path.exists() else {}
        check_tensors(extra_loaded, extra, extra_path, _FIX + " (trainable parameters outside the adapter)")

    def apply() -> None:
        for adapter, weights_path, loaded in staged:
            unexpected = load_adapter_state_dict(model, loaded, adapter)
            if unexpected:
                raise CheckpointError(f"{weights_path}: PEFT could not place tensors {unexpected[:3]}; {_FIX}")
        copy_tensors_into(extra, extra_loaded)

    return apply


def prepare_weights(model: torch.nn.Module, folder: Path, manifest: Mapping[str, Any]) -> Callable[[], None]:
    """Read and check every weight file for an unwrapped ``model``; return a function that puts them in.

    Nothing in the model changes until every file has been read and matched, so a mismatch never
    leaves a half-loaded model behind.
    """
    if is_peft(model):
        return _prepare_adapters(model, folder, manifest)
    if manifest.get("kind") != "full":
        raise CheckpointError(
            f"{folder} holds a LoRA adapter but the model is not a PeftModel; wrap the base model with the "
            f"same LoRA config (peft.get_peft_model) before resuming, or export the adapter instead"
        )
    weights_path = folder / FULL_WEIGHTS_NAME
    params = named_trainable_parameters(model)
    loaded = io.load_tensors(weights_path)
    check_tensors(loaded, params, weights_path, _FIX + " Frozen parameters must stay frozen between runs.")
    return lambda: copy_tensors_into(params, loaded)
