"""Optional fused Ascend kernels for LLaMA/Qwen-style decoders, applied per model instance on NPU.

Replaces, with the same maths:

- RMSNorm forward                 -> ``torch_npu.npu_rms_norm(x, gamma, epsilon=eps)[0]``
- SwiGLU MLP (silu(gate) * up)   -> ``torch_npu.npu_swiglu(cat([gate, up], -1), dim=-1)``
- rotary ``apply_rotary_pos_emb`` -> ``torch_npu.npu_rotary_mul(x, cos, sin)`` (half mode, BNSD)

Each kernel is applied only on the chip families and shapes its torch_npu / op-plugin
documentation supports (:data:`KERNEL_CHIPS`); elsewhere the eager code runs. Every patch is per
model instance: other models in the process, on the CPU or on another device, keep their code.
transformers' attention calls ``apply_rotary_pos_emb`` by its module-level name, so that name
is replaced by a dispatcher that takes the fused path only inside the forward of an attention
module this function patched, and only for shapes the kernel takes on that chip.
The MLP patch calls ``gate_proj``/``up_proj``/``down_proj`` as modules, so LoRA layers keep working.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpo_ascend.device.ascend import chip_family, soc_name
from grpo_ascend.device.backends import device_type, import_torch_npu
from grpo_ascend.errors import ConfigError, closest

logger = logging.getLogger(__name__)

PATCH_KINDS = ("rms_norm", "swiglu", "rotary")

#: Chip families (grpo_ascend.device.ascend.chip_family) on which each kernel is documented to work.
#: npu_rms_norm: Atlas training, A2, A3 and inference series (torch_npu 7.0 API reference).
#: npu_swiglu: Atlas A2/A3 only. npu_rotary_mul: Atlas training series with head_dim 128 and
#: cos/sin shaped 11SD; A2/A3 with head_dim even and < 896, B and N < 1000, cos/sin 11SD or B1SD.
KERNEL_CHIPS: dict[str, frozenset[str]] = {
    "rms_norm": frozenset({"training", "A2", "A3", "inference"}),
    "swiglu": frozenset({"A2", "A3"}),
    "rotary": frozenset({"training", "A2", "A3"}),
}

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


# --------------------------------------------------------------------------------------------
# rotary: a per-instance switch read by a module-level dispatcher
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RotaryPlan:
    """npu_rotary_mul for one model on one chip family; ``supports`` checks a call's shapes."""

    npu: Any
    family: str

    def supports(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, unsqueeze_dim: int) -> bool:
        """Whether the kernel takes q/k (BNSD) with cos/sin (B1SD or 11SD after unsqueeze) here."""
        if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
            return False
        batch, heads, seq, head_dim = q.shape
        if k.shape[-1] != head_dim or cos.shape[-1] != head_dim or head_dim % 2:
            return False
        if cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
            return False
        if self.family == "training":  # D = 128, cos/sin 11SD, B*N <= 8*S for BNSD (torch_npu 6.0/7.0 docs)
            return head_dim == 128 and cos.shape[0] == 1 and max(batch, heads, k.shape[1]) <= 1000 \
                and batch * max(heads, k.shape[1]) <= 8 * seq
        return head_dim < 896 and max(batch, heads, k.shape[1]) < 1000  # A2/A3, half mode


_ACTIVE_ROTARY: contextvars.ContextVar[RotaryPlan | None] = contextvars.ContextVar("npu_rotary_plan", default=None)


def _rotary_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """``apply_rotary_pos_emb(q, k, cos, sin, [position_ids,] unsqueeze_dim=1)``: fused inside patched attention."""
    params = list(inspect.signature(original).parameters.values())
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    position = names.index("unsqueeze_dim") - 4 if "unsqueeze_dim" in names else None
    default = next((p.default for p in params if p.name == "unsqueeze_dim" and p.default is not p.empty), 1)

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any):
        plan = _ACTIVE_ROTARY.get()
        if plan is None:
            return original(q, k, cos, sin, *args, **kwargs)
        if "unsqueeze_dim" in kwargs:
            unsqueeze_dim = kwargs["unsqueeze_dim"]
        elif position is not None and len(args) > position:
            unsqueeze_dim = args[position]
        else:
            unsqueeze_dim = default
        if not plan.supports(q, k, cos, unsqueeze_dim):
            return original(q, k, cos, sin, *args, **kwargs)
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = plan.npu.npu_rotary_mul(q, cos.to(q.dtype), sin.to(q.dtype))
        k_embed = plan.npu.npu_rotary_mul(k, cos.to(k.dtype), sin.to(k.dtype))
        return q_embed, k_embed

    setattr(apply_rotary_pos_emb, _MARK, original)
    return apply_rotary_pos_emb


def _install_dispatcher(owner: types.ModuleType) -> None:
    current = owner.apply_rotary_pos_emb
    if getattr(current, _MARK, None) is None:
        owner.apply_rotary_pos_emb = _rotary_dispatcher(current)


def _attention_forward(eager: Callable[..., Any], plan: RotaryPlan) -> Callable[..., Any]:
    """The class's attention forward with ``plan`` switched on for its duration (bound per instance,
    so a deep copy of the model rebinds it to the copy)."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        token = _ACTIVE_ROTARY.set(plan)
        try:
            return eager(self, *args, **kwargs)
        finally:
            _ACTIVE_ROTARY.reset(token)

    return forward


def rotary_scaling(model: nn.Module) -> float:
    """The largest ``attention_scaling`` of the model's rotary embeddings (1.0 for plain RoPE).

    transformers multiplies cos/sin by it (above 1 for YaRN, LongRoPE, ...); npu_rotary_mul needs
    cos/sin in [-1, 1], so any other value keeps the eager rotary code.
    """
    scales = [float(m.attention_scaling) for m in model.modules()
              if type(m).__name__.endswith("RotaryEmbedding") and getattr(m, "attention_scaling", None) is not None]
    return max(scales, key=lambda s: abs(s - 1.0), default=1.0)


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def _is_silu(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _model_device(model: nn.Module) -> torch.device | None:
    for tensor in model.parameters():
        return tensor.device
    return None


def _kinds_for_chip(kinds: list[str], family: str | None, name: str | None, model: nn.Module) -> list[str]:
    """The requested kinds this chip (and the model's rotary scaling) supports; logs the others."""
    usable = []
    for kind in kinds:
        if family not in KERNEL_CHIPS[kind]:
            logger.info("fused %s off: %s is not a documented chip for it (%s)", kind,
                        name or "an unknown SoC", ", ".join(sorted(KERNEL_CHIPS[kind])))
        elif kind == "rotary" and rotary_scaling(model) != 1.0:
            logger.info("fused rotary off: the rotary embedding scales cos/sin by %g (YaRN-style RoPE); "
                        "npu_rotary_mul needs them in [-1, 1]", rotary_scaling(model))
        else:
            usable.append(kind)
    return usable


def apply_npu_patches(
    model: nn.Module,
    device: torch.device | str | None = None,
    kinds: Iterable[str] = PATCH_KINDS,
) -> list[str]:
    """Swap eager LLaMA/Qwen kernels of ``model`` for fused Ascend ones; return a line per kind applied.

    ``device`` is where the model runs (default: its parameters' device); off NPU this is a no-op
    and returns []. The chip family comes from the SoC name torch_npu reports for ``device``;
    kernels its docs do not cover for that chip stay eager (logged). Modules already patched are
    skipped, so calling it twice is harmless. ``kinds`` selects among 'rms_norm', 'swiglu', 'rotary'.
    """
    kinds = list(kinds)
    for kind in kinds:
        if kind not in PATCH_KINDS:
            raise ConfigError(f"unknown NPU patch {kind!r}{closest(kind, PATCH_KINDS)}; expected some of {list(PATCH_KINDS)}")
    target = device if device is not None else _model_device(model)
    if target is None or device_type(target) != "npu":
        return []
    npu = import_torch_npu()
    name = soc_name(target)
    family = chip_family(name)
    kinds = _kinds_for_chip(kinds, family, name, model)

    patched: Counter[str] = Counter()
    rms_forward = _rms_norm_forward(npu)
    mlp_forward = _swiglu_forward(npu)
    plan = RotaryPlan(npu, family or "")
    for module in model.modules():
        cls_name = type(module).__name__
        if getattr(module, _MARK, None):
            continue
        if "rms_norm" in kinds and cls_name in _RMSNORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(rms_forward, module)
            setattr(module, _MARK, "npu_rms_norm")
            patched[f"npu_rms_norm: {{}} x {cls_name}"] += 1
        elif "swiglu" in kinds and cls_name in _MLP_CLASSES and _is_silu(module):
            if all(hasattr(module, attr) for attr in ("gate_proj", "up_proj", "down_proj")):
                module.forward = types.MethodType(mlp_forward, module)
                setattr(module, _MARK, "npu_swiglu")
                patched[f"npu_swiglu: {{}} x {cls_name}"] += 1
        elif "rotary" in kinds and cls_name in _ATTENTION_CLASSES:
            owner = sys.modules.get(type(module).__module__)
            if owner is not None and callable(getattr(owner, "apply_rotary_pos_emb", None)):
                _install_dispatcher(owner)
                module.forward = types.MethodType(_attention_forward(type(module).forward, plan), module)
                setattr(module, _MARK, "npu_rotary_mul")
                patched[f"npu_rotary_mul: {{}} x {cls_name}"] += 1
    order = {"npu_rms_norm": 0, "npu_swiglu": 1, "npu_rotary_mul": 2}
    lines = sorted((template.format(count) for template, count in patched.items()),
                   key=lambda line: (order[line.split(":")[0]], line))
    if lines:
        logger.info("fused kernels on %s (%s): %s", name, family, "; ".join(lines))
    return lines
