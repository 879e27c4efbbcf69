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
from pathlib import Path
from typing import Any

from grpo_ascend.errors import ConfigError, closest
from grpo_ascend.planning.vision_clip import CLIP_FAMILIES
from grpo_ascend.planning.vision_model import Config, ImageCost, VisionFamily, VisionShape
from grpo_ascend.planning.vision_qwen import QWEN_FAMILIES

__all__ = ["FAMILIES", "ImageCost", "VisionShape", "full_config", "parse_image_size", "processor_settings",
           "text_config", "vision_shape"]

#: Every planned vision-language family by ``model_type``.
FAMILIES: dict[str, VisionFamily] = {**QWEN_FAMILIES, **CLIP_FAMILIES}


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
    hidden, inter, layers = spec.layers(v)
    image = spec.image_cost(config, v, processor_settings(folder), image_size)
    saved, shared = spec.projector_saved(config, v, image)
    quick_gelu = 1 if v.get("hidden_act") == "quick_gelu" else 0  # x * sigmoid(1.702 x) keeps one more
    return VisionShape(family=family, tower=tower, projector=projector, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, image=image, saved_hidden=spec.saved_hidden,
                       saved_mlp=(4 if spec.gated_mlp else 2) + quick_gelu, embedding_saved=spec.embedding_saved,
                       projector_saved=saved, projector_input=shared,
                       projector_in_tower=spec.projector_in_tower)


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
