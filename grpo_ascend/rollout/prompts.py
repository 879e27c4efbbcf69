"""Prompts in and texts out, the same for every rollout backend: rendering, tokenizing, padding, decoding.

Prompts are plain strings or chat message lists (rendered with the tokenizer's chat template and
``add_generation_prompt``; tool rollouts add each prompt's tool schemas). Token ids are made once
here; backends take and return ids, never re-tokenising.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.errors import DataError
from grpo_ascend.length_buckets import round_up
from grpo_ascend.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[Mapping[str, object]]


@dataclass
class EncodedPrompts:
    """Token ids of each prompt (after ``max_prompt_length`` truncation) and the rendered texts."""

    ids: list[list[int]]
    texts: list[str]


class PromptEncoder:
    """Renders and tokenizes prompts with ``tokenizer``; see the module docstring."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(
        self, prompts: Sequence[Prompt], params: SamplingParams,
        tools: Sequence[Sequence[Mapping[str, Any]] | None] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> EncodedPrompts:
        """Render then tokenize; ``tools``: one schema list per prompt; ``chat_template_kwargs``
        default ``params.chat_template_kwargs``."""
        kwargs = chat_template_kwargs if chat_template_kwargs is not None else params.chat_template_kwargs
        return self.tokenize(self.render(prompts, kwargs, tools), params)

    def render(
        self, prompts: Sequence[Prompt], chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Sequence[Mapping[str, Any]] | None] | None = None,
    ) -> list[str]:
        """Each prompt as text: strings as they are, chat message lists through the chat template."""
        check_prompts(prompts)
        texts = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                texts.append(p)
            elif isinstance(p, Sequence) and all(isinstance(m, Mapping) for m in p) and len(p) > 0:
                if getattr(self.tokenizer, "chat_template", None) is None:
                    raise DataError(
                        f"prompt {i} is a chat message list but the tokenizer has no chat template; "
                        "set tokenizer.chat_template or pass plain-text prompts"
                    )
                schemas = {"tools": tools[i]} if tools is not None else {}
                texts.append(self.tokenizer.apply_chat_template(
                    list(p), **schemas, tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
                ))
            else:
                raise DataError(
                    f"prompt {i} must be a string or a non-empty list of {{'role', 'content'}} dicts, got {p!r:.80}"
                )
        return texts

    def tokenize(self, texts: list[str], params: SamplingParams) -> EncodedPrompts:
        """Token ids of ``texts`` (no special tokens added), cut from the left per ``params``."""
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        limit = params.max_prompt_length
        cut = []
        for i, row in enumerate(ids):
            if len(row) == 0:
                raise DataError(f"prompt {i} is empty after tokenization; every prompt needs at least one token")
            if limit is not None and len(row) > limit:
                if params.prompt_truncation == "error":
                    raise DataError(
                        f"prompt {i} has {len(row)} tokens, more than max_prompt_length={limit}; shorten it, "
                        "raise max_prompt_length, or set prompt_truncation='left' to keep its last tokens"
                    )
                ids[i] = row[-limit:]
                texts[i] = self.tokenizer.decode(ids[i], skip_special_tokens=False)
                cut.append(i)
        if cut:
            logger.warning(
                "truncated %d prompt(s) from the left to max_prompt_length=%d (indices %s)", len(cut), limit, cut[:20]
            )
        return EncodedPrompts(ids, texts)

    def decode_completions(self, ids: Tensor, lengths: list[int], stop_strings: Sequence[str] = ()) -> list[str]:
        """Each row's first ``lengths[i]`` tokens as text (special tokens skipped), cut at a stop string."""
        rows = ids.tolist()
        texts = self.tokenizer.batch_decode([r[:n] for r, n in zip(rows, lengths)], skip_special_tokens=True)
        return [cut_at_stop(s, stop_strings) for s in texts] if stop_strings else texts


def check_prompts(prompts: object) -> None:
    """Raise a clear error unless ``prompts`` is a non-empty list (of prompts; each is checked at rendering)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise DataError(
            f"prompts must be a list of strings or chat message lists, got {type(prompts).__name__}; "
            "wrap one prompt in a list"
        )
    if len(prompts) == 0:
        raise DataError("the prompt list is empty: pass at least one prompt")


def left_pad(ids: Sequence[Sequence[int]], pad: int, bucket: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Prompts left-padded to a bucketed length: (ids [P, Lp] long, mask [P, Lp] bool), built on the host, copied once."""
    lens = [len(r) for r in ids]
    lp = round_up(max(lens), bucket)
    host_ids = torch.tensor([[pad] * (lp - len(r)) + list(r) for r in ids], dtype=torch.long)
    host_mask = torch.arange(lp).unsqueeze(0) >= torch.tensor([lp - n for n in lens]).unsqueeze(1)
    return host_ids.to(device), host_mask.to(device)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """Text before the earliest occurrence of any stop string (unchanged if none occurs)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]
