"""Tokenizers, chat templates and processors of the built-in vision-language models, and a processor loader
that keeps image-only use working without torchvision.

The tokenizer is the tiny text models' byte-level BPE (:mod:`grpo_ascend.models.tiny_tokenizer`) plus each
family's image tokens. The chat templates render conversational content parts (``{"type": "image"}``,
``{"type": "text", "text": ...}``) as the real families' templates do: Qwen2.5-VL puts
``<|vision_start|><|image_pad|><|vision_end|>`` where each image is; LLaVA-1.5 puts ``<image>\\n`` before the
turn's text. The processors expand each image token to the image's number of feature tokens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_ascend.models.tiny_tokenizer import EOS_TOKEN, build_tokenizer

QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_TOKENS = ["<image>"]

# Qwen2.5-VL's template without its default system turn (as the tiny text template): a string content
# renders as is; a list renders its parts in order, each image (or video) as its three vision tokens.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Picture ' + image_count.value | string + ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Video ' + video_count.value | string + ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# LLaVA-1.5's template (llava-hf): ``USER: <image>\n<text> ASSISTANT:``; a turn's images first, then its
# text; the system turn's text without a role. Assistant turns end with the tokenizer's EOS (the original
# LLaVA conversation's ``</s>``) so that a completion's end is a token the model learns to emit.
LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] != 'system' %}{{- message['role'].upper() + ': ' }}{%- endif %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}"
    "{%- for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{- '<image>\\n' }}{%- endfor %}"
    "{%- for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{- content['text'] }}{%- if not loop.last %}{{- ' ' }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{- '" + EOS_TOKEN + "' }}{%- endif %}"
    "{{- ' ' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"
)


#: Gemma 4's image (and, for its processor, audio and video) tokens: ``<|image>`` opens a picture's soft tokens
#: ``<|image|>`` and ``<image|>`` closes them.
GEMMA4_NAMED_TOKENS = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
                       "boa_token": "<|audio>", "audio_token": "<|audio|>", "eoa_token": "<audio|>"}
GEMMA4_TOKENS = [*GEMMA4_NAMED_TOKENS.values(), "<|video|>"]

# Gemma 4's turn format (``<|turn>role\n ... ``, the assistant as ``model``) with the tiny tokenizer's end of turn (its EOS), each image as
# ``<|image|>`` where it is (the processor expands it to ``<|image>`` + soft tokens + ``<image|>``).
GEMMA4_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '" + EOS_TOKEN + "\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|turn>model\\n' }}{%- endif %}"
)


def vlm_tokenizer(image_tokens: list[str], chat_template: str, seed: int = 0, named: dict[str, str] | None = None):
    """The tiny BPE tokenizer with ``image_tokens`` appended as special tokens (every other id unchanged)
    and ``chat_template`` as its template; ``named``: special tokens its processor reads by name (Gemma 4's
    ``image_token``, ``boi_token``, ...: ``tokenizer.image_token`` / ``image_token_id``)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokenizer = build_tokenizer(seed=seed)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in image_tokens], special_tokens=True)
    if named:
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token=EOS_TOKEN,
                                            pad_token=tokenizer.pad_token, padding_side="left",
                                            extra_special_tokens=named)
    tokenizer.chat_template = chat_template
    return tokenizer


#: Processors whose video part needs torchvision in transformers 5.25 (their video processor class, as saved):
#: each has an image-only stand-in, :func:`image_only_processor`.
VIDEO_PROCESSORS: dict[str, str] = {
    "Qwen2VLProcessor": "Qwen2VLVideoProcessor",
    "Qwen2_5_VLProcessor": "Qwen2VLVideoProcessor",
    "Qwen3VLProcessor": "Qwen3VLVideoProcessor",
    "Gemma4Processor": "Gemma4VideoProcessor",
}


def _image_and_text(base: type) -> Callable:
    """The stand-in's ``__init__`` of a processor of an image processor and a tokenizer (Qwen-VL): transformers
    reads a processor's parts from its ``__init__``'s arguments, so this one names no video processor."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):  # noqa: N807
        kwargs.pop("video_processor", None)  # a saved folder's video section: unused without torchvision
        base.__init__(self, image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                      chat_template=chat_template, **kwargs)

    return __init__


def _audio_image_and_text(base: type) -> Callable:
    """As :func:`_image_and_text`, for a processor with an audio feature extractor too (Gemma 4)."""

    def __init__(self, feature_extractor=None, image_processor=None, tokenizer=None, chat_template=None,  # noqa: N807
                 **kwargs):
        kwargs.pop("video_processor", None)
        base.__init__(self, feature_extractor=feature_extractor, image_processor=image_processor,
                      tokenizer=tokenizer, video_processor=None, chat_template=chat_template, **kwargs)

    return __init__


@functools.cache
def _without_video() -> type:
    """A ``ProcessorMixin`` whose ``__init__`` drops the video processor a processor's own ``__init__`` hands it
    by name (Gemma 4's): it sits between that processor and ``ProcessorMixin`` in a stand-in's class order."""
    from transformers import ProcessorMixin

    def __init__(self, *args, **kwargs):  # noqa: N807
        kwargs.pop("video_processor", None)
        ProcessorMixin.__init__(self, *args, **kwargs)

    return type("WithoutVideoProcessor", (ProcessorMixin,), {"__init__": __init__, "__module__": __name__})


#: Each image-only stand-in's ``__init__``, by its processor's parts.
_INITS: dict[str, Callable[[type], Callable]] = {"Gemma4Processor": _audio_image_and_text}
_VIDEO_SETTINGS = ("patch_size", "temporal_patch_size", "merge_size", "size", "image_mean", "image_std", "resample")
_IMAGE_ONLY_PREFIX = "ImageOnly"


@functools.cache
def image_only_processor(name: str) -> type:
    """``ImageOnly<name>``: the processor class ``name`` (a key of :data:`VIDEO_PROCESSORS`) without its video
    processor, for images only.

    transformers 5.25 cannot build these processors without torchvision (their video processor needs it, and the
    processor's type check of that argument fails without it). The subclass declares no video processor, so it
    builds and loads with the PIL image processor alone; it saves under the real class's name (with a matching
    video processor section), so ``AutoProcessor`` loads the folder wherever torchvision works. Made on first use,
    so importing this module does not import transformers; it still pickles (a rollout process can receive it), as
    this module's ``ImageOnly<name>`` attribute.
    """
    if name not in VIDEO_PROCESSORS:
        raise ValueError(f"no image-only stand-in for processor {name!r}; expected one of {sorted(VIDEO_PROCESSORS)}")
    import transformers

    base = getattr(transformers, name)
    video_type = VIDEO_PROCESSORS[name]

    def to_dict(self) -> dict[str, Any]:
        """The real processor's config: its class name, and a video processor matching the image settings."""
        out = base.to_dict(self)
        image = out["image_processor"]
        out["video_processor"] = {"video_processor_type": video_type,
                                  **{key: image[key] for key in _VIDEO_SETTINGS if key in image}}
        out["processor_class"] = name
        return out

    init = _INITS.get(name, _image_and_text)(base)
    cls = type(_IMAGE_ONLY_PREFIX + name, (base, _without_video()),
               {"__init__": init, "to_dict": to_dict, "__module__": __name__})
    return cls


def image_only_qwen2_5_vl_processor() -> type:
    """Qwen2.5-VL's image-only processor class (:func:`image_only_processor`)."""
    return image_only_processor("Qwen2_5_VLProcessor")


def __getattr__(name: str) -> type:
    """``ImageOnly<processor>`` by name (what pickle looks up), made on first use."""
    base = name.removeprefix(_IMAGE_ONLY_PREFIX)
    if name.startswith(_IMAGE_ONLY_PREFIX) and base in VIDEO_PROCESSORS:
        return image_only_processor(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_vlm_processor(path: str | Path, **kwargs: Any):
    """A vision-language model's processor (a folder or a hub id): ``AutoProcessor``'s when torchvision is
    installed, else, for the processors whose video part needs torchvision (:data:`VIDEO_PROCESSORS`), their
    image-only stand-in. ``kwargs`` go to ``from_pretrained`` (e.g. ``padding_side``)."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    name = _processor_class(str(path))
    if is_torchvision_available() or name not in VIDEO_PROCESSORS:
        return AutoProcessor.from_pretrained(path, **kwargs)
    return image_only_processor(name).from_pretrained(path, **kwargs)


def _processor_class(source: str) -> str | None:
    """The processor class a model folder or hub id names: in processor_config.json, or (older saves, such as
    the released Qwen2.5-VL checkpoints) in preprocessor_config.json."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = _config_file(source, name)
        if path is not None:
            return json.loads(path.read_text()).get("processor_class")
    return None


def _config_file(source: str, name: str) -> Path | None:
    """``name`` in the folder ``source``, or in the hub repository ``source`` (the local cache when offline);
    None when it has no such file."""
    folder = Path(source)
    if folder.is_dir():
        return folder / name if (folder / name).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(source, name))
    except (EntryNotFoundError, LocalEntryNotFoundError, HFValidationError, OSError):
        return None
