"""The PEFT internals grpo-ascend relies on, in one place (pinned to peft 0.21).

Folding LoRA into the base weights for rollouts (:func:`grpo_ascend.models.lora_merge.lora_merged`) reads
a LoRA layer's own state and switches its adapter path off without PEFT's ``merge()`` (which
would change the stored base weights by ``W + Δ - Δ`` rounding): the layer classes in
``peft.tuners.lora.layer``, their ``merged`` / ``disable_adapters`` / ``active_adapters`` /
``lora_A`` / ``lora_variant`` attributes, ``get_base_layer()``, ``get_delta_weight()`` and the
private ``_disable_adapters`` flag. :data:`PINNED_INTERNALS` lists each with a probe on a real
LoRA layer; tests/distributed/test_compat.py runs them, so a peft release that changes one fails there with a
:class:`CompatError` naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from grpo_ascend.errors import CompatError


def _changed(what: str) -> CompatError:
    import peft

    return CompatError(f"peft {peft.__version__} changed {what}, which grpo-ascend relies on to merge LoRA for "
                       "rollouts; use peft 0.21 (or update grpo_ascend/models/compat_peft.py)")


def _layer_classes() -> tuple[type, type] | None:
    """(LoraLayer, LoRA Linear), or None when this peft has no such module."""
    try:
        from peft.tuners.lora.layer import Linear, LoraLayer
    except ImportError:
        return None
    return LoraLayer, Linear


def lora_linear_class() -> type:
    """peft's LoRA ``Linear`` layer class (for :mod:`grpo_ascend.models.lora_kernel`'s subclass)."""
    classes = _layer_classes()
    if classes is None:
        raise _changed("the module peft.tuners.lora.layer (LoraLayer, Linear)")
    return classes[1]


def _is_plain_linear(layer: nn.Module, classes: tuple[type, type]) -> bool:
    """peft's LoRA ``Linear`` itself or a subclass that computes the same (``computes_plain_lora``)."""
    return type(layer) is classes[1] or getattr(type(layer), "computes_plain_lora", False)


class LoraParts(NamedTuple):
    """What one plain LoRA call computes: ``x·weightᵀ + bias + scaling · dropout(x)·lora_aᵀ·lora_bᵀ``."""

    weight: Tensor
    bias: Tensor | None
    lora_a: Tensor
    lora_b: Tensor
    scaling: float
    dropout: nn.Module


def plain_lora_parts(layer: nn.Module, x: Tensor) -> LoraParts | None:
    """The weights of ``layer``'s call on ``x`` when it is plain LoRA: adapters on and unmerged, exactly
    one active adapter, no variant (DoRA, ...), no LoRA bias, a floating-point ``nn.Linear`` base in
    ``x``'s dtype (any floating dtypes under autocast, which casts them). None otherwise (peft's own
    forward then runs)."""
    if layer.merged or layer.disable_adapters:
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1 or active[0] in layer.lora_variant:
        return None
    name = active[0]
    base, lora_a, lora_b = layer.get_base_layer(), layer.lora_A[name], layer.lora_B[name]
    if type(base) is not nn.Linear or type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
        return None
    if lora_b.bias is not None or lora_a.bias is not None:
        return None
    dtypes = {x.dtype, base.weight.dtype, lora_a.weight.dtype, lora_b.weight.dtype}
    if not all(d.is_floating_point for d in dtypes):
        return None
    if len(dtypes) > 1 and not torch.is_autocast_enabled(x.device.type):
        return None
    return LoraParts(base.weight, base.bias, lora_a.weight, lora_b.weight, float(layer.scaling[name]),
                     layer.lora_dropout[name])


def lora_layers(model: nn.Module) -> Iterator[nn.Module]:
    """Every LoRA layer of ``model`` (none when peft has no LoRA layer module)."""
    classes = _layer_classes()
    if classes is None:
        return
    for module in model.modules():
        if isinstance(module, classes[0]):
            yield module


def mergeable_adapters(layer: nn.Module) -> list[str] | None:
    """The active adapters of a LoRA ``layer`` that can be folded into its weight ([] if none is on);
    None when the layer computes more than ``W + B·A·scaling`` (a LoRA variant such as DoRA, or a
    quantised or custom layer type)."""
    if layer.merged or layer.disable_adapters:
        return []
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    classes = _layer_classes()
    if active and (classes is None or not _is_plain_linear(layer, classes)
                   or any(a in layer.lora_variant for a in active)):
        return None
    return active


def base_weight(layer: nn.Module) -> nn.Parameter:
    return layer.get_base_layer().weight


def delta_weight(layer: nn.Module, adapter: str) -> Tensor:
    """``B·A·scaling`` of one adapter, shaped like the base weight."""
    return layer.get_delta_weight(adapter)


def set_adapter_path(layer: nn.Module, enabled: bool) -> None:
    """Switch the layer's adapter computation on or off without touching its weights."""
    layer._disable_adapters = not enabled


@functools.lru_cache(maxsize=1)
def _probe_layer() -> nn.Module:
    """A real LoRA linear layer built by this peft (for the probes)."""
    import torch
    from peft import LoraConfig, get_peft_model

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.proj(x)

    torch.manual_seed(0)
    model = get_peft_model(Net(), LoraConfig(r=2, target_modules=["proj"]))
    layers = list(lora_layers(model))
    if not layers:
        raise _changed("the module peft.tuners.lora.layer (LoraLayer, Linear)")
    return layers[0]


def _has(name: str) -> Callable[[], Any]:
    def probe() -> Any:
        layer = _probe_layer()
        if not hasattr(layer, name):
            raise _changed(f"LoraLayer.{name}")
        return getattr(layer, name)

    return probe


def _probe_disable_flag() -> None:
    layer = _probe_layer()
    if not hasattr(layer, "_disable_adapters"):
        raise _changed("LoraLayer._disable_adapters")
    set_adapter_path(layer, False)
    try:
        if not layer.disable_adapters:
            raise _changed("LoraLayer._disable_adapters (no longer read by disable_adapters)")
    finally:
        set_adapter_path(layer, True)


def _probe_delta() -> None:
    layer = _probe_layer()
    try:
        delta = delta_weight(layer, "default")
    except (AttributeError, TypeError) as exc:
        raise _changed("LoraLayer.get_delta_weight(adapter)") from exc
    if delta.shape != base_weight(layer).shape:
        raise _changed("the shape of LoraLayer.get_delta_weight(adapter)")


def _probe_forward() -> None:
    """peft's Linear still computes base(x) + lora_B(lora_A(dropout(x))) * scaling (what lora_kernel fuses)."""
    import torch

    layer = _probe_layer()
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
        x = torch.randn(3, 4)
        parts = plain_lora_parts(layer, x)
        if parts is None:
            raise _changed("the attributes plain_lora_parts reads (lora_A/lora_B/scaling/lora_dropout)")
        expected = x @ parts.weight.T + parts.bias + (x @ parts.lora_a.T) @ parts.lora_b.T * parts.scaling
        got = layer(x)
        layer.lora_B["default"].weight.zero_()
    if not torch.allclose(got, expected, atol=1e-6):
        raise _changed("LoRA Linear.forward (no longer base(x) + lora_B(lora_A(dropout(x))) * scaling)")


#: name -> probe; each raises CompatError naming the internal when the installed peft changed it.
PINNED_INTERNALS: dict[str, Callable[[], Any]] = {
    "peft.tuners.lora.layer.LoraLayer/Linear": _probe_layer,
    **{f"LoraLayer.{name}": _has(name) for name in ("merged", "disable_adapters", "active_adapters", "lora_A",
                                                     "lora_variant", "get_base_layer")},
    "LoraLayer._disable_adapters": _probe_disable_flag,
    "LoraLayer.get_delta_weight": _probe_delta,
    **{f"LoraLayer.{name}": _has(name) for name in ("lora_B", "lora_dropout", "scaling")},
    "LoraLayer Linear forward (the fused kernel's reference)": _probe_forward,
}
