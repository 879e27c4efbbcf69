"""Vision-language policies: telling one apart, its processor, and which of its parts train.

A model is vision-language when its config has a ``vision_config`` (every transformers image-text-to-text
family). It loads with ``AutoModelForImageTextToText``; its processor renders chats with images and
expands each image into image tokens (rollout and training take the token ids and pixel inputs it
returns). LoRA's ``all-linear`` targets the language model's linear layers only, and full fine-tuning
freezes the vision tower and projector: GRPO's reward rarely says anything about how to see, and the
vision tower is where a small batch does the most damage.
"""

from __future__ import annotations

import logging
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


def language_model_linear_targets(model: nn.Module) -> str:
    """A PEFT ``target_modules`` regex: the linear layers inside the language model (not the vision tower,
    projector or output head)."""
    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, nn.Linear) and ".language_model." in f".{name}."})
    if not leaves:
        raise ConfigError(f"{type(model).__name__} has no linear layers under a 'language_model' module; give "
                          "peft_config.target_modules explicitly")
    return rf".*\.language_model\..*\.({'|'.join(leaves)})"


def freeze_vision(model: nn.Module) -> int:
    """Freeze every parameter outside the language model and output head (vision tower, projector); returns
    how many tensors were frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        if ".language_model." not in f".{name}." and "lm_head" not in name and param.requires_grad:
            param.requires_grad_(False)
            frozen += 1
    return frozen

