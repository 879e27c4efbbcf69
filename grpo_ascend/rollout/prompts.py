"""Prompts into token ids, the same way for every rollout backend.

Plain-text prompts pass through; chat message lists are rendered with the tokenizer's chat
template (with the generation prompt). Tokenization adds no special tokens (the template has
them) and enforces ``max_prompt_length`` by refusing or by keeping the last tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_ascend.errors import DataError

logger = logging.getLogger(__name__)

Prompt = str | Sequence[Mapping[str, object]]


def render_prompts(tokenizer: Any, prompts: Sequence[Prompt],
                   chat_template_kwargs: Mapping[str, Any] | None = None) -> list[str]:
    """The prompt texts: strings as given, chat message lists through the tokenizer's chat template."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise DataError(
            f"prompts must be a list of strings or chat message lists, got {type(prompts).__name__}; wrap one prompt in a list"
        )
    if len(prompts) == 0:
        raise DataError("the prompt list is empty: pass at least one prompt")
    texts = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            texts.append(p)
        elif isinstance(p, Sequence) and all(isinstance(m, Mapping) for m in p) and len(p) > 0:
            if getattr(tokenizer, "chat_template", None) is None:
                raise DataError(
                    f"prompt {i} is a chat message list but the tokenizer has no chat template; "
                    "set tokenizer.chat_template or pass plain-text prompts"
                )
            texts.append(tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True,
                                                       **dict(chat_template_kwargs or {})))
        else:
            raise DataError(
                f"prompt {i} must be a string or a non-empty list of {{'role', 'content'}} dicts, got {p!r:.80}"
            )
    return texts


def tokenize_prompts(tokenizer: Any, texts: list[str], max_prompt_length: int | None,
                     truncation: str) -> tuple[list[list[int]], list[str]]:
    """Token ids of each text (no special tokens added) and the texts, cut from the left when
    ``truncation == 'left'`` and longer than ``max_prompt_length`` (else such a prompt is refused)."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    texts = list(texts)
    cut = []
    for i, row in enumerate(ids):
        if len(row) == 0:
            raise DataError(f"prompt {i} is empty after tokenization; every prompt needs at least one token")
        if max_prompt_length is not None and len(row) > max_prompt_length:
            if truncation == "error":
                raise DataError(
                    f"prompt {i} has {len(row)} tokens, more than max_prompt_length={max_prompt_length}; shorten it, "
                    "raise max_prompt_length, or set prompt_truncation='left' to keep its last tokens"
                )
            ids[i] = row[-max_prompt_length:]
            texts[i] = tokenizer.decode(ids[i], skip_special_tokens=False)
            cut.append(i)
    if cut:
        logger.warning("truncated %d prompt(s) from the left to max_prompt_length=%d (indices %s)",
                       len(cut), max_prompt_length, cut[:20])
    return ids, texts
