"""A vision-language model's shape for the memory plan: the text decoder as a :class:`ModelShape` plus a
:class:`VisionShape` (vision tower and projector parameters, what one image costs), from shapes alone.

A config is vision-language when it has a ``vision_config``. It is read through transformers' config class of
its ``model_type`` (which fills in defaults a hub ``config.json`` leaves out, and takes both the flat hub layout
and the nested ``text_config`` one); each family in :data:`FAMILIES` counts its tower and projector and says
how many image tokens, vision-tower patches and pixel elements one image becomes, from the processor's
settings in the model folder (``processor_config.json`` / ``preprocessor_config.json``) or the processor's
defaults.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_ascend.errors import ConfigError, closest

Config = Mapping[str, Any]


@dataclass(frozen=True)
class ImageCost:
    """What one image becomes: image tokens in the prompt, vision-tower positions, float32 pixel elements."""

    tokens: int
    patches: int
    pixel_elements: int
    #: How the size was chosen, for the plan's header (e.g. "56x56 from --image-size", "fixed 336x336").
    size_note: str


@dataclass(frozen=True)
class VisionShape:
    """The vision part of a vision-language model (frozen in training: weights only)."""

    family: str
    tower_params: int
    projector_params: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    image: ImageCost

    @property
    def num_params(self) -> int:
        return self.tower_params + self.projector_params

    @property
    def transient_elements(self) -> int:
        """Elements one patch holds at once inside one vision layer's no-grad forward (as the decoder's term)."""
        return 5 * self.hidden_size + 3 * self.intermediate_size


@dataclass(frozen=True)
class VisionFamily:
    """How one family's tower, projector and images are counted."""

    #: (config, vision config) -> (tower parameters, projector parameters)
    parameters: Callable[[Config, Config], tuple[int, int]]
    #: (config, vision config, processor settings, (width, height) or None) -> ImageCost
    image_cost: Callable[[Config, Config, Config, tuple[int, int] | None], ImageCost]
    #: The text decoder's q/k/v projections have biases (Qwen2 style).
    text_attention_bias: bool


def _qwen2_5_vl_parameters(config: Config, v: Config) -> tuple[int, int]:
    """Patch embedding (a bias-free 3D conv), ``depth`` blocks (RMS norms, biased qkv/proj, gated MLP with
    biases); the merger (RMS norm, two biased linears over ``merge²`` patches) is the projector."""
    h, i, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * h
    block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (3 * h * i + 2 * i + h)
    merger = h + (merged * merged + merged) + (merged * v["out_hidden_size"] + v["out_hidden_size"])
    return patch + v["depth"] * block, merger


def _clip_tower(v: Config) -> int:
    """CLIP's vision transformer: class + patch + position embeddings, pre/post layer norms, biased layers."""
    h, i = v["hidden_size"], v["intermediate_size"]
    positions = (v["image_size"] // v["patch_size"]) ** 2 + 1
    embeddings = h + v["num_channels"] * v["patch_size"] ** 2 * h + positions * h
    layer = 4 * (h * h + h) + 4 * h + (h * i + i) + (i * h + h)
    return embeddings + 2 * h + v["num_hidden_layers"] * layer + 2 * h


def _llava_parameters(config: Config, v: Config) -> tuple[int, int]:
    """A CLIP tower and LLaVA's two-linear projector (from every selected vision layer to the text hidden)."""
    if v.get("model_type") != "clip_vision_model":
        raise ConfigError(f"a LLaVA vision tower of type {v.get('model_type')!r} cannot be planned yet (CLIP only)")
    layers = config.get("vision_feature_layer", -2)
    width = v["hidden_size"] * (len(layers) if isinstance(layers, list) else 1)
    text = config["text_config"]["hidden_size"]
    bias = 1 if config.get("multimodal_projector_bias", True) else 0
    return _clip_tower(v), width * text + bias * text + text * text + bias * text


def _size_setting(processor: Config, key: str, size_key: str, default: int) -> int:
    size = processor.get("size") or {}
    return int(processor.get(key) or size.get(size_key) or default)


def _qwen_image_cost(config: Config, v: Config, processor: Config, size: tuple[int, int] | None) -> ImageCost:
    """Qwen-VL's processor resizes to a multiple of ``patch × merge`` within [min_pixels, max_pixels]; without
    a size the largest square image it makes is planned."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch = int(processor.get("patch_size") or v["patch_size"])
    merge = int(processor.get("merge_size") or v["spatial_merge_size"])
    temporal = int(processor.get("temporal_patch_size") or v["temporal_patch_size"])
    low = _size_setting(processor, "min_pixels", "shortest_edge", 56 * 56)
    high = _size_setting(processor, "max_pixels", "longest_edge", 28 * 28 * 1280)
    width, height = size if size is not None else (math.isqrt(high),) * 2
    h, w = smart_resize(height, width, factor=patch * merge, min_pixels=low, max_pixels=high)
    patches = (h // patch) * (w // patch)
    note = f"{width}x{height} from --image-size" if size is not None else f"the largest square, max_pixels {high}"
    return ImageCost(tokens=patches // merge**2, patches=patches,
                     pixel_elements=patches * v["in_channels"] * temporal * patch**2,
                     size_note=f"{note} -> {w}x{h} pixels")


def _llava_image_cost(config: Config, v: Config, processor: Config, size: tuple[int, int] | None) -> ImageCost:
    """LLaVA's processor resizes and crops every image to the tower's square: a fixed count whatever the size."""
    crop = processor.get("crop_size") or {}
    side = int(crop.get("height") or v["image_size"])
    grid = (side // v["patch_size"]) ** 2
    extra = 1 if config.get("vision_feature_select_strategy") == "full" else 0
    return ImageCost(tokens=grid + extra, patches=grid + 1, pixel_elements=v["num_channels"] * side * side,
                     size_note=f"every image resized to {side}x{side}")


FAMILIES: dict[str, VisionFamily] = {
    "qwen2_5_vl": VisionFamily(_qwen2_5_vl_parameters, _qwen_image_cost, text_attention_bias=True),
    "llava": VisionFamily(_llava_parameters, _llava_image_cost, text_attention_bias=False),
}

#: Per family: the vision config's (hidden size, intermediate size, layers) keys.
_LAYER_KEYS = {"qwen2_5_vl": ("hidden_size", "intermediate_size", "depth"),
               "llava": ("hidden_size", "intermediate_size", "num_hidden_layers")}


def processor_settings(folder: Path | None) -> dict[str, Any]:
    """The image processor's saved settings in a model folder ({} when it has none: the defaults apply)."""
    if folder is None:
        return {}
    combined, flat = folder / "processor_config.json", folder / "preprocessor_config.json"
    if combined.is_file():
        return dict(json.loads(combined.read_text()).get("image_processor") or {})
    return dict(json.loads(flat.read_text())) if flat.is_file() else {}


def full_config(raw: Config, source: str) -> dict[str, Any]:
    """``raw`` through transformers' config class of its model_type: every default filled in, ``text_config``
    and ``vision_config`` as dicts."""
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"{source}: vision-language model_type {model_type!r} cannot be planned yet; planned "
                          f"families: {sorted(FAMILIES)}{closest(str(model_type), FAMILIES)}")
    return AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"}).to_dict()


def text_config(config: Config) -> dict[str, Any]:
    """The text decoder's config as :meth:`ModelShape.from_config` reads it (bias, tying, dtype from the top)."""
    text = dict(config["text_config"])
    text["attention_bias"] = text.get("attention_bias", FAMILIES[config["model_type"]].text_attention_bias)
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text["dtype"] = config.get("dtype") or text.get("dtype")
    return text


def vision_shape(config: Config, folder: Path | None = None, image_size: tuple[int, int] | None = None) -> VisionShape:
    """The vision part of a :func:`full_config` (``folder``: where the processor's settings are, if any)."""
    family, v = config["model_type"], config["vision_config"]
    spec = FAMILIES[family]
    tower, projector = spec.parameters(config, v)
    hidden, inter, layers = (int(v[k]) for k in _LAYER_KEYS[family])
    return VisionShape(family=family, tower_params=tower, projector_params=projector, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers,
                       image=spec.image_cost(config, v, processor_settings(folder), image_size))


def parse_image_size(text: str | None) -> tuple[int, int] | None:
    """``--image-size``: 'WxH' or one side for a square (None stays None)."""
    if text is None:
        return None
    parts = str(text).lower().split("x")
    try:
        sides = tuple(int(p) for p in parts)
    except ValueError:
        sides = ()
    if len(sides) not in (1, 2) or min(sides, default=0) <= 0:
        raise ConfigError(f"--image-size {text!r} is not a size; expected WIDTHxHEIGHT (e.g. 448x336) or one side")
    return (sides[0], sides[-1])
