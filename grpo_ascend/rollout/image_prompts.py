"""Prompts with images to token ids and image inputs, through a vision-language model's processor.

Chat prompts are rendered with the processor's chat template; a prompt whose messages name no image part
gets one ``{"type": "image"}`` part per image at the start of its first user message (TRL's rule), and a
plain-text prompt with images becomes that user message. The processor expands each image into its image
tokens, so a prompt is never cut: one longer than ``max_prompt_length`` is refused with its count.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_ascend.errors import DataError
from grpo_ascend.rollout.prompts import EncodedPrompts, Prompt, check_prompts
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.vision.inputs import PromptImages


def _image_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, Mapping) and part.get("type") == "image")


def with_image_parts(prompt: Prompt, num_images: int, index: int) -> list[dict[str, Any]]:
    """``prompt`` as chat messages whose parts name ``num_images`` images (see the module docstring)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else copy.deepcopy(list(prompt))
    named = _image_parts(messages)
    if named == num_images:
        return messages
    if named:
        raise DataError(f"prompt {index} has {named} image part(s) but its row has {num_images} image(s); "
                        "give one {'type': 'image'} part per image, or none to put them all first")
    user = next((m for m in messages if m.get("role") == "user"), None)
    if user is None:
        raise DataError(f"prompt {index} has images but no user message to put them in")
    content = user["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    user["content"] = [{"type": "image"} for _ in range(num_images)] + text
    return messages


class VisionPromptEncoder:
    """Renders and encodes prompts with their images through ``processor``; see the module docstring."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def encode(self, prompts: Sequence[Prompt], images: Sequence[Sequence[Any]], params: SamplingParams,
               chat_template_kwargs: Mapping[str, Any] | None = None,
               tools: Sequence[Sequence[Mapping[str, Any]] | None] | None = None,
               ) -> tuple[EncodedPrompts, list[PromptImages]]:
        """Token ids, rendered texts and image inputs of each prompt (``images``: each prompt's PIL images;
        ``tools``: one tool schema list per prompt, for the chat template)."""
        check_prompts(prompts)
        kwargs = dict((chat_template_kwargs if chat_template_kwargs is not None else params.chat_template_kwargs) or {})
        ids, texts, inputs = [], [], []
        for i, (prompt, pictures) in enumerate(zip(prompts, images)):
            if pictures or not isinstance(prompt, str):
                messages = with_image_parts(prompt, len(pictures), i)
                schemas = {"tools": tools[i]} if tools is not None and tools[i] else {}
                text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                          **schemas, **kwargs)
            else:
                text = prompt
            out = self.processor(text=[text], images=list(pictures) or None, return_tensors="pt",
                                 add_special_tokens=False)
            row = out["input_ids"][0].tolist()
            limit = params.max_prompt_length
            if limit is not None and len(row) > limit:
                raise DataError(
                    f"prompt {i} has {len(row)} tokens with its {len(pictures)} image(s) expanded, more than "
                    f"max_prompt_length={limit}; prompts with images are never cut: raise max_prompt_length, "
                    "or make the images smaller (the image processor's max_pixels / size)")
            ids.append(row)
            texts.append(text)
            inputs.append(PromptImages.from_processor(out, len(pictures), pictures))
        return EncodedPrompts(ids, texts), inputs
