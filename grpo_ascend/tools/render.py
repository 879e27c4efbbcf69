"""Turning tool results into the tokens appended after an assistant turn, with the chat template.

The model's turn ends with the template's end-of-turn token (EOS, e.g. ``<|im_end|>``). What
follows, the tool messages and the next assistant header, is rendered by the tokenizer's own chat
template (role ``tool``) on a minimal conversation and taken as the difference from the same
conversation without the tool messages, so only the new tokens are prefilled and no conversation
is re-tokenized. (Same approach as TRL's ``_get_tool_suffix_ids``.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from grpo_ascend.errors import ConfigError
from grpo_ascend.tools.execution import ToolResult


def _messages(results: Sequence[ToolResult | Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [r.tool_message() if isinstance(r, ToolResult) else dict(r) for r in results]


def render_tool_suffix(
    tokenizer: Any,
    results: Sequence[ToolResult | Mapping[str, Any]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids to append after an assistant turn that ended with EOS: the tool responses of
    ``results`` (in call order) and the generation prompt of the next assistant turn."""
    if not results:
        raise ValueError("render_tool_suffix needs at least one tool result")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            "the tokenizer has no chat template; tool responses are rendered with it (role 'tool')"
        )
    tool_messages = _messages(results)
    kwargs = dict(chat_template_kwargs or {})
    dummy_calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    head = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": dummy_calls},
    ]
    prefix = _ids(tokenizer.apply_chat_template(head, tokenize=True, add_generation_prompt=False, **kwargs))
    full = _ids(
        tokenizer.apply_chat_template(
            head + tool_messages, tokenize=True, add_generation_prompt=True, **kwargs
        )
    )
    eos = tokenizer.eos_token_id
    ends = [i for i, t in enumerate(prefix) if t == eos]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ConfigError(
            "the chat template renders the assistant turn differently when tool messages follow it, so the "
            "tool response cannot be appended as a suffix; use a template whose assistant turn ends with EOS"
        )
    return full[len(prefix) :]


def render_tool_suffix_text(
    tokenizer: Any,
    results: Sequence[ToolResult | Mapping[str, Any]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The text of :func:`render_tool_suffix` (for logs and samples)."""
    return tokenizer.decode(
        render_tool_suffix(tokenizer, results, chat_template_kwargs), skip_special_tokens=False
    )


def _ids(rendered: Any) -> list[int]:
    if isinstance(rendered, Mapping):  # transformers 5 may return a BatchEncoding
        rendered = rendered["input_ids"]
    return list(rendered)
