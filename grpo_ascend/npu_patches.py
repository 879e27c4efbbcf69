"""Optional fused Ascend kernels for LLaMA/Qwen-style decoders, applied only on NPU.

Replaces, in place and with the same maths:

- RMSNorm forward                 -> ``torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]``
- SwiGLU MLP (silu(gate) * up)   -> ``torch_npu.npu_swiglu(cat([gate, up], -1), dim=-1)``
- rotary ``apply_rotary_pos_emb`` -> ``torch_npu.npu_rotary_mul(x, cos, sin)`` (rotate-half layout)

RMSNorm and MLP patches are per module instance (other models in the process keep their
forward). The rotary patch replaces the module-level function of the model family, because
transformers' attention calls it by global name; the fused version falls back to the original
for shapes the kernel does not take (non-4D tensors, partial rotary).
The MLP patch calls ``gate_proj``/``up_proj``/``down_proj`` as modules, so LoRA layers keep working.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from grpo_ascend.device import device_type, import_torch_npu
from grpo_ascend.errors import ConfigError, closest

PATCH_KINDS = ("rms_norm", "swiglu", "rotary")

_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe")
_RMSNORM_CLASSES = frozenset(f"{family}RMSNorm" for family in _FAMILIES)
_MLP_CLASSES = frozenset(f"{family}MLP" for family in _FAMILIES)
_ATTENTION_CLASSES = frozenset(f"{family}Attention" for family in _FAMILIES)
_MARK = "_grpo_ascend_npu_patch"


def _rms_norm_forward(npu: Any) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        # Same output dtype as the eager module: promote(input dtype, weight dtype).
        dtype = torch.promote_types(hidden_states.dtype, self.weight.dtype)
        return npu.npu_rms_norm(hidden_states.to(dtype), self.weight.to(dtype), epsilon=self.variance_epsilon)[0]

    return forward


def _swiglu_forward(npu: Any) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(npu.npu_swiglu(gate_up, dim=-1))

    return forward


def _fused_rotary(original: Callable[..., Any], npu: Any) -> Callable[..., Any]:
    """Wrap ``apply_rotary_pos_emb(q, k, cos, sin, [position_ids,] unsqueeze_dim=1)`` with npu_rotary_mul."""
    params = list(inspect.signature(original).parameters.values())
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    position = names.index("unsqueeze_dim") - 4 if "unsqueeze_dim" in names else None
    default = next((p.default for p in params if p.name == "unsqueeze_dim" and p.default is not p.empty), 1)

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any):
        if "unsqueeze_dim" in kwargs:
            unsqueeze_dim = kwargs["unsqueeze_dim"]
        elif position is not None and len(args) > position:
            unsqueeze_dim = args[position]
        else:
            unsqueeze_dim = default
        head_dim = q.shape[-1]
        if q.dim() != 4 or k.dim() != 4 or head_dim % 2 or cos.shape[-1] != head_dim or k.shape[-1] != head_dim:
            return original(q, k, cos, sin, *args, **kwargs)
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = npu.npu_rotary_mul(q, cos.to(q.dtype), sin.to(q.dtype))
        k_embed = npu.npu_rotary_mul(k, cos.to(k.dtype), sin.to(k.dtype))
        return q_embed, k_embed

    setattr(apply_rotary_pos_emb, _MARK, original)
    return apply_rotary_pos_emb


def _is_silu(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _kind_order(line: str) -> tuple[int, str]:
    """Report rms_norm before swiglu regardless of module traversal order."""
    return (0 if line.startswith("npu_rms_norm") else 1, line)


def _model_device(model: nn.Module) -> torch.device | None:
    for tensor in model.parameters():
        return tensor.device
    return None


def apply_npu_patches(
    model: nn.Module,
    device: torch.device | str | None = None,
    kinds: Iterable[str] = PATCH_KINDS,
) -> list[str]:
    """Swap eager LLaMA/Qwen kernels for fused Ascend ones; return a line per kind patched.

    ``device`` defaults to the device of the model's parameters. Off NPU this is a no-op and
    returns []. Modules already patched are skipped, so calling it twice is harmless.
    ``kinds`` selects among 'rms_norm', 'swiglu' and 'rotary'.
    """
    kinds = list(kinds)
    for kind in kinds:
        if kind not in PATCH_KINDS:
            raise ConfigError(f"unknown NPU patch {kind!r}{closest(kind, PATCH_KINDS)}; expected some of {list(PATCH_KINDS)}")
    target = device if device is not None else _model_device(model)
    if target is None or device_type(target) != "npu":
        return []
    npu = import_torch_npu()

    patched: Counter[str] = Counter()
    rotary_modules: dict[str, types.ModuleType] = {}
    rms_forward = _rms_norm_forward(npu)
    mlp_forward = _swiglu_forward(npu)
    for module in model.modules():
        cls_name = type(module).__name__
        if getattr(module, _MARK, None):
            continue
        if "rms_norm" in kinds and cls_name in _RMSNORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(rms_forward, module)
            setattr(module, _MARK, "npu_rms_norm")
            patched[f"npu_rms_norm: {{}} x {cls_name}"] += 1
        elif "swiglu" in kinds and cls_name in _MLP_CLASSES and _is_silu(module):
            if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj")):
                module.forward = types.MethodType(mlp_forward, module)
                setattr(module, _MARK, "npu_swiglu")
                patched[f"npu_swiglu: {{}} x {cls_name}"] += 1
        elif "rotary" in kinds and cls_name in _ATTENTION_CLASSES:
            owner = sys.modules.get(type(module).__module__)
            if owner is not None and callable(getattr(owner, "apply_rotary_pos_emb", None)):
                rotary_modules[owner.__name__] = owner

    lines = sorted((template.format(count) for template, count in patched.items()), key=_kind_order)
    for name, owner in sorted(rotary_modules.items()):
        current = owner.apply_rotary_pos_emb
        if getattr(current, _MARK, None) is not None:
            continue
        owner.apply_rotary_pos_emb = _fused_rotary(current, npu)
        lines.append(f"npu_rotary_mul: {name}.apply_rotary_pos_emb")
    return lines
