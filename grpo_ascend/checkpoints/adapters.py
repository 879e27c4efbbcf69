"""The trainable weights of a live model: LoRA adapters in PEFT's format, or plain trainable parameters.

What checkpoints save and load and what export writes: the adapter names (the top-level one
first), an adapter's state dict and config as PEFT writes them, the trainable tensors outside
any adapter (a PPO value head), and strict name-and-shape checks before copying values in.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpo_ascend.errors import CheckpointError

#: LoRA hyper-parameters that change what the weights mean without changing their shapes.
ADAPTER_CONFIG_FIELDS = (
    "peft_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "use_dora",
    "rank_pattern",
    "alpha_pattern",
    "bias",
    "lora_bias",
)


def adapter_names(model: nn.Module) -> list[str]:
    """A PeftModel's adapter names, the top-level one first: 'default' as in PEFT's layout, else the active one.

    The top-level adapter is what ``PeftModel.from_pretrained(base, CHECKPOINT)`` and export use.
    """
    names = list(model.peft_config)
    active = getattr(model, "active_adapter", None)
    first = "default" if "default" in names else active
    if isinstance(first, str) and first in names:
        names.remove(first)
        names.insert(0, first)
    return names


def adapter_state_dict(
    model: nn.Module, adapter: str, weights: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """One adapter's tensors under PEFT's saved names (``weights``: whole tensors when the model's are sharded)."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: frozen base weights (embeddings included) come from the base model.
    return get_peft_model_state_dict(model, state_dict=weights, adapter_name=adapter, save_embedding_layers=False)


def load_adapter_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor], adapter: str) -> list[str]:
    """Put ``tensors`` (PEFT's saved names) into ``adapter``; returns the names PEFT could not place."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, dict(tensors), adapter_name=adapter)
    return list(getattr(result, "unexpected_keys", []) or [])


def adapter_config_dict(model: nn.Module, adapter: str) -> dict[str, Any]:
    """The adapter's config as PEFT writes it: sets as lists, inference_mode on, base model recorded."""
    config = copy.deepcopy(model.peft_config[adapter])
    if not getattr(config, "base_model_name_or_path", None):
        base = model.get_base_model()
        config.base_model_name_or_path = getattr(base, "name_or_path", None) or None
    config.inference_mode = True
    out = config.to_dict()
    for key, value in list(out.items()):
        if isinstance(value, set):
            out[key] = sorted(value)
    return out


def named_trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by name; tied weights appear once (named_parameters removes duplicates)."""
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def non_adapter_trainable(
    model: nn.Module, weights: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Trainable tensors of a PeftModel that belong to no adapter (e.g. a value head), by name.

    ``weights``: the trainable tensors by name to pick from, instead of the model's own.
    """
    adapters = set(model.peft_config)
    source = weights.items() if weights is not None else named_trainable_parameters(model).items()
    return {name: param for name, param in source if not adapters.intersection(name.split("."))}


def check_adapter_config(saved: Mapping[str, Any], model: nn.Module, adapter: str, path: Path) -> None:
    """Same LoRA hyper-parameters: a different alpha with the same rank would load silently but be wrong."""
    current = adapter_config_dict(model, adapter)
    for key in ADAPTER_CONFIG_FIELDS:
        mine, theirs = current.get(key), saved.get(key)
        if mine != theirs and (mine or theirs):  # None, {} and False all mean "unset"
            raise CheckpointError(
                f"{path}: LoRA setting {key!r} is {theirs!r} in the checkpoint but {mine!r} in the model "
                f"being resumed; build the model with the LoRA config the checkpoint was trained with"
            )


def check_tensors(
    loaded: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], path: Path, how_to_fix: str
) -> None:
    """Raise CheckpointError unless ``loaded`` has exactly the names and shapes of ``expected``."""
    missing = [name for name in expected if name not in loaded]
    unexpected = [name for name in loaded if name not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) the model needs are missing (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensor(s) the model does not have (e.g. {unexpected[:3]})")
        raise CheckpointError(f"{path} does not match the model: {'; '.join(parts)}. {how_to_fix}")
    for name, tensor in expected.items():
        got = tuple(loaded[name].shape)
        if got != tuple(tensor.shape):
            raise CheckpointError(
                f"{path} does not match the model: tensor {name!r} has shape {list(got)} in the checkpoint "
                f"but {list(tensor.shape)} in the model. {how_to_fix}"
            )


def copy_tensors_into(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    """Copy ``values[name]`` into each of ``params`` in place, cast to its device and dtype."""
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(values[name].to(device=param.device, dtype=param.dtype))
