"""A stand-alone copy of the policy for a sampler of its own, and the tensors each weight sync sends it.

The copy is a plain transformers model (LoRA folded in, no PEFT wrapper) on the CPU. A sync then
replaces only what training changes: with LoRA, each adapted layer's merged weight ``W + B·A·s``
(and any fully trained ``modules_to_save`` copy); with full fine-tuning, every parameter.
Names are the plain model's state-dict names on both sides.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.models import compat_peft
from grpo_ascend.models.lora_merge import lora_merged
from grpo_ascend.models.wrappers import is_peft

_SAVED_COPY = re.compile(r"\.modules_to_save\.[^.]+")


def sampler_copy(policy: nn.Module) -> nn.Module:
    """The policy's current weights as a plain model on the CPU, in eval mode, without gradients."""
    with torch.no_grad():
        model = copy.deepcopy(policy)
        if is_peft(model):
            model = model.merge_and_unload()
        model = model.to("cpu").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def synced_tensors(policy: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The tensors one weight sync sends, under the plain model's names (see the module docstring).

    With LoRA the merged weights exist only while this iterator runs (inside :func:`lora_merged`);
    consume it at once.
    """
    if not is_peft(policy):
        yield from _unwrapped(policy).named_parameters()
        return
    base = policy.get_base_model()
    layers = {id(m) for m in compat_peft.lora_layers(base)}
    with lora_merged(policy) as merged:
        if layers and not merged:
            raise ConfigError("a rollout process takes plain LoRA layers (W + B·A·s); this adapter's layers (DoRA or "
                              "another variant) can't be folded into the weights. Use rollout_mode: sync")
        for name, module in base.named_modules():
            if id(module) in layers:
                yield f"{name}.weight", compat_peft.base_weight(module)
        for name, param in base.named_parameters():
            if param.requires_grad and "lora_" not in name and ".modules_to_save." in name:
                yield _SAVED_COPY.sub("", name), param


def _unwrapped(policy: nn.Module) -> nn.Module:
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy
