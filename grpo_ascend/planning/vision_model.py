"""What the memory plan knows of a vision-language model's vision part: its tower and projector
(:class:`PartShape`: parameters and linear layers), what one image costs (:class:`ImageCost`) and how a family
counts them (:class:`VisionFamily`, the entries of :data:`grpo_ascend.planning.vision_shape.FAMILIES`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Config = Mapping[str, Any]


@dataclass(frozen=True)
class Linear:
    """``count`` linear layers of ``in_features`` x ``out_features`` (what LoRA adapts under all-linear)."""

    in_features: int
    out_features: int
    count: int = 1


@dataclass(frozen=True)
class PartShape:
    """One vision part (the tower or the projector): every parameter, and its ``nn.Linear`` layers."""

    params: int
    linears: tuple[Linear, ...] = ()

    def lora_params(self, r: int) -> int:
        """LoRA A and B elements of rank ``r`` on every linear layer of the part."""
        return r * sum(x.count * (x.in_features + x.out_features) for x in self.linears)

    @property
    def linear_weights(self) -> int:
        """Elements of the linear layers' weights (what merging LoRA copies)."""
        return sum(x.count * x.in_features * x.out_features for x in self.linears)


@dataclass(frozen=True)
class ImageCost:
    """What one image becomes: image tokens in the prompt, vision-tower positions, float32 pixel elements, and
    positions the projector runs over."""

    tokens: int
    patches: int
    pixel_elements: int
    #: How the size was chosen, for the plan's header (e.g. "56x56 from --image-size", "fixed 336x336").
    size_note: str
    #: Positions the projector maps (LLaVA: every tile's patches without CLS; Qwen-VL: merged tokens).
    projected: int = 0


@dataclass(frozen=True)
class VisionShape:
    """The vision part of a vision-language model: tower and projector, one vision layer's widths, one image."""

    family: str
    tower: PartShape
    projector: PartShape
    hidden_size: int
    intermediate_size: int
    num_layers: int
    image: ImageCost
    #: Elements one patch keeps for the backward in one vision layer, in hidden widths and MLP widths (measured
    #: with autograd's saved-tensor hooks per family: norms, q / k / v, rotary copies, attention output, the
    #: MLP's hidden before and after its activation -- three for quick GELU, four gated).
    saved_hidden: int = 8
    saved_mlp: int = 2
    #: ... and once per patch before the layers (patch embedding, positions, norms), in hidden widths.
    embedding_saved: int = 4
    #: Elements per image the projector keeps for its backward (norms, hidden activations).
    projector_saved: int = 0
    #: ... and of its input, kept apart only over a frozen tower (a trained tower's last layer keeps it already).
    projector_input: int = 0
    #: The projector is a module inside the tower (Qwen-VL's ``visual.merger``): training the tower trains it.
    projector_in_tower: bool = False

    @property
    def tower_params(self) -> int:
        return self.tower.params

    @property
    def projector_params(self) -> int:
        return self.projector.params

    @property
    def num_params(self) -> int:
        return self.tower.params + self.projector.params

    def part(self, name: str) -> PartShape:
        """A part by its ``train_vision_parts`` name ('projector' or 'vision_tower')."""
        return {"projector": self.projector, "vision_tower": self.tower}[name]

    @property
    def transient_elements(self) -> int:
        """Elements one patch holds at once inside one vision layer's no-grad forward (as the decoder's term)."""
        return 5 * self.hidden_size + 3 * self.intermediate_size

    @property
    def saved_elements(self) -> int:
        """Elements one patch keeps for the backward in one vision layer."""
        return self.saved_hidden * self.hidden_size + self.saved_mlp * self.intermediate_size


@dataclass(frozen=True)
class VisionFamily:
    """How one family's tower, projector and images are counted."""

    #: (config, vision config) -> (tower, projector)
    parameters: Callable[[Config, Config], tuple[PartShape, PartShape]]
    #: (config, vision config, processor settings, (width, height) or None) -> ImageCost
    image_cost: Callable[[Config, Config, Config, tuple[int, int] | None], ImageCost]
    #: (vision config) -> (hidden size, intermediate size, layers)
    layers: Callable[[Config], tuple[int, int, int]]
    #: (config, vision config, one image) -> elements the projector keeps for its backward: (beside its input,
    #: its input when that is not the tower's last saved layer output)
    projector_saved: Callable[[Config, Config, ImageCost], tuple[int, int]]
    #: The text decoder's q/k/v projections have biases (Qwen2 style).
    text_attention_bias: bool
    #: What one patch keeps per vision layer beyond the MLP, and before the layers, in hidden widths.
    saved_hidden: int = 8
    embedding_saved: int = 4
    #: The MLP is gated (Qwen2.5-VL: gate, up, down): four MLP widths kept instead of two.
    gated_mlp: bool = False
    projector_in_tower: bool = False
