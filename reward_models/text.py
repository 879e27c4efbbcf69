"""Turning a completion (plain string or list of chat messages, as TRL passes them) into text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo_ascend.errors import RewardError


def _content_text(content: Any) -> str:
    """Text of one message's ``content``: a string, or a list of parts (``{"type": "text", "text": ...}``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    raise RewardError(
        f"message content must be a string or a list of text parts, got {type(content).__name__}"
    )


def completion_text(completion: Any) -> str:
    """The text of one completion.

    A string is returned as is. A list of chat messages (TRL's conversational format,
    ``[{"role": "assistant", "content": "..."}]``) gives the concatenated content of its assistant
    messages, or of all messages when none has the assistant role (tool outputs are skipped that way).
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        if not all(isinstance(m, Mapping) for m in completion):
            raise RewardError(
                "a completion given as a list must be a list of chat messages (dicts with 'role' and "
                f"'content'), got a list containing {type(next(m for m in completion if not isinstance(m, Mapping))).__name__}"
            )
        assistant = [m for m in completion if m.get("role") == "assistant"]
        return "".join(_content_text(m.get("content")) for m in (assistant or completion))
    raise RewardError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


def is_conversational(value: Any) -> bool:
    """True when ``value`` is a list of chat messages (dicts with a ``role`` key)."""
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in value)
    )
