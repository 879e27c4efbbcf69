"""What is done to a loaded policy's parameters: the adapter-disabled reference forward (its
``requires_grad`` flags kept), the output head in float32, frozen copies and TR-DPO's reference mixing,
and parameter counts."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import hf_model
from grpo_ascend.models.wrappers import is_peft


@contextlib.contextmanager
def preserve_requires_grad(model: nn.Module) -> Iterator[None]:
    """Restore every parameter's ``requires_grad`` on exit.

    peft flips these flags as a side effect: ``set_adapter`` leaves only the active adapter
    trainable, and leaving ``disable_adapter()`` (the reference forward) re-applies that, which
    would silently freeze a second adapter such as PPO's critic.
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model of a PeftModel (the reference policy) without a second copy in memory.

    Every parameter's ``requires_grad`` is kept as it was (see :func:`preserve_requires_grad`).
    """
    if not is_peft(model):
        raise ConfigError("adapters_disabled needs a PEFT model")
    with preserve_requires_grad(model), model.disable_adapter():
        yield


def cast_head_to_fp32(model: nn.Module) -> None:
    """Keep ``model``'s output head in float32 and run it in float32, outside autocast (ScaleRL; TRL's
    ``cast_lm_head_to_fp32``): every caller of the head (training log-probs, reference, rollout) gets
    float32 logits of float32 hidden states, whatever the model's dtype. A head tied to the input
    embeddings shares its now float32 weight with them; their output is cast back to the model's dtype
    (as TRL does). A head carrying an adapter is refused (the adapter would never be trained here)."""
    hf = hf_model(model)
    head = hf.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ConfigError(f"cast_lm_head_to_fp32: the output head is a {type(head).__name__}, not a plain Linear "
                          "(an adapter on the head?); remove it from the adapter's target modules or set "
                          "cast_lm_head_to_fp32=False")
    embeddings = hf.get_input_embeddings()
    dtype = head.weight.dtype
    head.float()
    head.forward = _fp32_linear_forward.__get__(head)  # an instance attribute: deepcopy rebinds it to the copy
    if embeddings is not None and getattr(embeddings, "weight", None) is head.weight and dtype != torch.float32:
        embeddings.register_forward_hook(functools.partial(_output_as, dtype))


def _output_as(dtype: torch.dtype, module: nn.Module, inputs: Any, output: Tensor) -> Tensor:
    return output.to(dtype)


def _fp32_linear_forward(self: nn.Linear, hidden: Tensor) -> Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        return nn.functional.linear(hidden.float(), self.weight.float(),
                                    None if self.bias is None else self.bias.float())


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen deep copy (the reference for full fine-tuning)."""
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    ref.eval()
    return ref


@torch.no_grad()
def mix_into_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """TR-DPO's reference update, in place: each reference weight becomes α·policy + (1 − α)·reference.

    Parameters are matched by name; both models must have the same ones (the reference is a copy)."""
    ref_params = dict(reference.named_parameters())
    policy_params = dict(policy.named_parameters())
    if ref_params.keys() != policy_params.keys():
        missing = sorted(ref_params.keys() ^ policy_params.keys())[:3]
        raise ConfigError(f"the reference and the policy have different parameters (e.g. {missing}); "
                          "sync_ref_model needs the reference to be a copy of the policy")
    for name, ref in ref_params.items():
        ref.mul_(1 - alpha).add_(policy_params[name].detach().to(ref.dtype), alpha=alpha)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: nn.Module, numel: Callable[[nn.Parameter], int] = torch.numel) -> tuple[int, int]:
    """(trainable, total) parameter counts, shared tensors counted once; ``numel``: a parameter's size
    (the distributed strategy's ``parameter_numel`` counts a partitioned parameter whole)."""
    seen: dict[int, tuple[int, bool]] = {}
    for p in model.parameters():
        seen[id(p)] = (numel(p), p.requires_grad)
    return sum(n for n, t in seen.values() if t), sum(n for n, _ in seen.values())
