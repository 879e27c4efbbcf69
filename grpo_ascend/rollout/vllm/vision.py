"""Prompts with images for vLLM: which vision-language families it serves here, and each prompt as vLLM takes it.

vLLM 0.32 expands a prompt's image placeholders itself: a token-id prompt with ``multi_modal_data`` must hold
each image's placeholder once (LLaVA's ``<image>``, Qwen-VL's ``<|image_pad|>``), where the trainer's ids (the
processor's output) hold it once per image feature. :func:`placeholder_prompt` collapses each run of the image
token back to one; vLLM runs the model folder's processor on the pictures and expands them again, and
:func:`check_expansion` requires its prompt to equal the trainer's token for token, so the sampler and the
trainer's log-prob forward read the same prompt. A prompt's ``G`` completions are one request (``n = G``), so
its images are processed and encoded once per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpo_ascend.errors import ConfigError, RolloutError
from grpo_ascend.models.vision_language import config_of, is_vision_language
from grpo_ascend.rollout.vllm.compat_vision import torchvision_available

#: Head sizes vLLM 0.32's CPU attention runs (its CPU backend refuses others at the first request).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family vLLM serves with images here: the config attribute holding its image token id,
    and whether vLLM builds its processor with a video part that needs torchvision."""

    image_token_attr: str
    needs_torchvision: bool = False


#: model_type -> family; tested on the CPU: llava, qwen2_5_vl (without torchvision: compat_vision.py gives vLLM an
#: image-only processor). Qwen2-VL is refused without torchvision (vLLM loads its processor with its video
#: processor) and is untested with it.
VISION_FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionFamily("image_token_index"),
    "qwen2_vl": VisionFamily("image_token_id", needs_torchvision=True),
    "qwen2_5_vl": VisionFamily("image_token_id"),
}


def vision_family(config: Any, where: str) -> VisionFamily:
    """The :class:`VisionFamily` of a vision-language model ``config``, or one ConfigError line saying why vLLM
    cannot serve it with images here (``where``: the model's folder or id, for the message)."""
    model_type = getattr(config, "model_type", None)
    family = VISION_FAMILIES.get(str(model_type))
    fallback = "or sample with the built-in engine (use_vllm: false)"
    if family is None:
        raise ConfigError(f"vLLM with images is supported here for {sorted(VISION_FAMILIES)}; {where} is a "
                          f"{model_type!r} model: {fallback}")
    if family.needs_torchvision and not torchvision_available():
        raise ConfigError(f"vLLM 0.32 cannot serve the {model_type!r} model {where} with images here: it builds that "
                          "family's processor with its video processor, which needs torchvision, and torchvision does "
                          f"not import in this environment; install a torchvision matching your torch, {fallback}")
    image_token = getattr(config, family.image_token_attr, None)
    if image_token is None:
        raise ConfigError(f"the {model_type!r} config of {where} has no {family.image_token_attr}; vLLM cannot place "
                          f"its images: {fallback}")
    return family


def served_image_token(model: str, cpu_attention: bool = False) -> int | None:
    """The image token id of the model folder or id ``model`` that vLLM will serve, its family checked
    (:func:`vision_family`); None for a text-only model. ``cpu_attention``: also check the head size vLLM's CPU
    build runs."""
    config = config_of(model)
    if config is None:
        return None
    if cpu_attention:
        check_cpu_head_size(config, model)
    if not is_vision_language(config):
        return None
    family = vision_family(config, model)
    return int(getattr(config, family.image_token_attr))


def check_cpu_head_size(config: Any, where: str) -> None:
    """Refuse a text decoder whose head size vLLM's CPU attention does not run (it fails at the first request)."""
    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_attention_heads", None)
    size = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if size is not None and int(size) not in CPU_HEAD_SIZES:
        raise ConfigError(f"vLLM's CPU attention runs head sizes {list(CPU_HEAD_SIZES)}; the text decoder of {where} "
                          f"has {size}: sample it with the built-in engine (use_vllm: false), or serve it on an "
                          "accelerator (a tiny built-in VLM: build_tiny_vlm(..., head_dim=32))")


def placeholder_prompt(prompt_ids: Sequence[int], image_token: int) -> list[int]:
    """``prompt_ids`` with each run of ``image_token`` collapsed to one (what vLLM expands per image)."""
    out: list[int] = []
    for token in prompt_ids:
        if not (token == image_token and out and out[-1] == image_token):
            out.append(int(token))
    return out


def check_expansion(ours: Sequence[int], theirs: Sequence[int] | None, index: int, num_images: int) -> None:
    """vLLM's prompt after expanding the images must be the trainer's; else one RolloutError line."""
    if theirs is None or list(theirs) == list(ours):
        return
    raise RolloutError(f"vLLM expanded prompt {index} ({num_images} image(s)) into {len(theirs)} tokens where the "
                       f"model's processor gives {len(ours)}; the sampler and the trainer would read different "
                       "prompts. Check that vLLM loads the same processor settings (processor_config.json), or sample "
                       "with the built-in engine (use_vllm: false)")
