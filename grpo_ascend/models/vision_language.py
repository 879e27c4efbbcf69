"""Vision-language policies: telling one apart, its processor, and which of its parts train.

A model is vision-language when its config has a ``vision_config`` (every transformers image-text-to-text
family). It loads with ``AutoModelForImageTextToText``; its processor renders chats with images and
expands each image into image tokens (rollout and training take the token ids and pixel inputs it
returns). What trains is ``train_vision_parts``: null (the default, TRL's choice) trains the whole model in full
fine-tuning and the language model's adapters under LoRA (LoRA's ``all-linear`` targets the language model's
linear layers only); ``[]`` the language model only (full fine-tuning freezes the vision tower and projector:
GRPO's reward rarely says anything about how to see, and the tower is where a small batch does the most damage);
``projector`` / ``vision_tower`` add those parts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.tiny_vlm_processors import load_vlm_processor

logger = logging.getLogger(__name__)


def is_vision_language(config: Any) -> bool:
    """Whether a model config describes a vision-language model."""
    return getattr(config, "vision_config", None) is not None


def config_of(model: str | nn.Module, init_kwargs: dict[str, Any] | None = None) -> Any:
    """The model's config, read without loading weights when ``model`` is a path or id (None if unreadable)."""
    if isinstance(model, nn.Module):
        return getattr(model, "config", None)
    from transformers import AutoConfig

    shared = {k: v for k, v in (init_kwargs or {}).items() if k in ("revision", "trust_remote_code") and v is not None}
    try:
        return AutoConfig.from_pretrained(model, **shared)
    except (OSError, ValueError):
        return None


def takes_processor_images(processing_class: Any) -> bool:
    """Whether ``processing_class`` is a multimodal processor (a tokenizer plus an image processor)."""
    return getattr(processing_class, "image_processor", None) is not None and hasattr(processing_class, "tokenizer")


#: Files a saved multimodal processor leaves in its folder (one of them).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(path: str | Path) -> Any:
    """The processor saved with a vision-language model (image-only where torchvision is missing)."""
    try:
        processor = load_vlm_processor(path)
    except OSError as exc:
        raise ConfigError(f"could not load the processor of the vision-language model {path}: {exc}".splitlines()[0]
                          + "; pass processing_class=<its processor>") from exc
    if not takes_processor_images(processor):
        raise ConfigError(f"the processor loaded for {path} ({type(processor).__name__}) takes no images; pass "
                          "processing_class=<the model's image-text processor>")
    return processor


#: The parts of a vision-language model that ``train_vision_parts`` may name: module-name pieces of each
#: (LLaVA's ``multi_modal_projector`` / ``vision_tower``, LLaVA-NeXT's ``image_newline`` too, Qwen-VL's
#: ``visual.merger`` / ``visual``, Gemma 4's ``embed_vision``).
VISION_PARTS: dict[str, tuple[str, ...]] = {
    "projector": (".multi_modal_projector.", ".visual.merger.", ".mm_projector.", ".image_newline.",
                  ".embed_vision."),
    "vision_tower": (".vision_tower.", ".visual.", ".vision_model."),
}


def check_vision_parts(parts: Sequence[str] | None) -> tuple[str, ...] | None:
    """``train_vision_parts`` checked against :data:`VISION_PARTS` (None, TRL's choice, passes as is)."""
    if parts is None:
        return None
    unknown = [p for p in parts if p not in VISION_PARTS]
    if unknown:
        raise ConfigError(f"train_vision_parts {unknown} unknown: choose from {sorted(VISION_PARTS)} (or null for "
                          "TRL's choice)")
    return tuple(parts)


def trains_whole_model(parts: Sequence[str] | None, lora: bool) -> bool:
    """Whether a vision-language model trains every parameter: ``train_vision_parts`` null (TRL's choice) in full
    fine-tuning, as TRL's ``GRPOTrainer`` does (under LoRA TRL's choice is the language model's adapters)."""
    return parts is None and not lora


def _in_parts(name: str, parts: Sequence[str]) -> bool:
    dotted = f".{name}."
    return any(piece in dotted for part in parts for piece in VISION_PARTS[part])


def _trained(name: str, parts: Sequence[str]) -> bool:
    """Whether a module or parameter named ``name`` trains: the language model, the head, or a chosen part
    (the projector sits inside Qwen-VL's vision tower, so choosing only it leaves the rest frozen)."""
    return ".language_model." in f".{name}." or "lm_head" in name or _in_parts(name, parts)


def language_model_linear_targets(model: nn.Module, parts: Sequence[str] = ()) -> str:
    """A PEFT ``target_modules`` regex: the linear layers inside the language model and the chosen
    ``parts`` (never the output head)."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and "lm_head" not in name and _trained(name, parts)]
    if not any(".language_model." in f".{n}." for n in names):
        raise ConfigError(f"{type(model).__name__} has no linear layers under a 'language_model' module; give "
                          "peft_config.target_modules explicitly")
    return "|".join(re.escape(n) for n in names)


def freeze_vision(model: nn.Module, parts: Sequence[str] = ()) -> int:
    """Freeze every parameter outside the language model, the output head and the chosen ``parts``; returns
    how many tensors were frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        if not _trained(name, parts) and param.requires_grad:
            param.requires_grad_(False)
            frozen += 1
    return frozen

