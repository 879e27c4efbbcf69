"""Tool responses with images, rendered for a vision-language model: the suffix's token ids and its image inputs.

A text tool response is rendered by the tokenizer (:func:`grpo_ascend.tools.render.render_tool_suffix`). When a
row's results carry images, the same difference of two renderings is taken as text, with the processor's chat
template (each image part is the family's placeholder), and the suffix goes through the processor with the
images, which expands each placeholder into the image's tokens and returns its pixel inputs. The result is a
:class:`~grpo_ascend.vision.inputs.ToolImages` whose columns count from the suffix's first token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from grpo_ascend.errors import ConfigError
from grpo_ascend.tools.execution import ToolResult
from grpo_ascend.vision.inputs import PromptImages, ToolImages


def has_images(results: Sequence[ToolResult]) -> bool:
    """Whether any of ``results`` returned images."""
    return any(r.images for r in results)


def image_token_id(processor: Any) -> int:
    """The token id the processor expands each image into (its ``image_token_id`` or ``image_token``)."""
    found = getattr(processor, "image_token_id", None)
    if found is None and getattr(processor, "image_token", None) is not None:
        found = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    if not isinstance(found, int):
        raise ConfigError(f"{type(processor).__name__} names no image token (image_token_id / image_token); tools "
                          "returning images need a vision-language model's processor")
    return found


def render_image_suffix(processor: Any, results: Sequence[ToolResult],
                        chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], ToolImages]:
    """Token ids to append after an assistant turn (the tool responses of ``results``, their images expanded, and
    the next assistant header) and their images' inputs; see the module docstring."""
    messages = [r.tool_message() for r in results]
    kwargs = dict(chat_template_kwargs or {})
    calls = [{"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = processor.apply_chat_template(head, tokenize=False, add_generation_prompt=False, **kwargs)
    full = processor.apply_chat_template(head + messages, tokenize=False, add_generation_prompt=True, **kwargs)
    eos = processor.tokenizer.eos_token
    if eos and eos in prefix:
        prefix = prefix[: prefix.rindex(eos) + len(eos)]
    if not full.startswith(prefix):
        raise ConfigError("the chat template renders the assistant turn differently when tool messages follow it, so "
                          "the tool response cannot be appended; use a template whose assistant turn ends with EOS")
    images = [image for r in results for image in r.images]
    out = processor(text=[full[len(prefix):]], images=images, return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0]
    columns = (ids == image_token_id(processor)).nonzero().squeeze(1).tolist()
    per_image = PromptImages.from_processor(out, len(images)).per_image
    if not columns:
        raise ConfigError("the chat template rendered no image placeholder for the tool's images; its tool messages "
                          "must render image parts (docs/vlm.md#tools-that-return-images)")
    return ids.tolist(), ToolImages({k: v.to(torch.device("cpu")) for k, v in per_image.items()}, tuple(columns),
                                   len(images))
