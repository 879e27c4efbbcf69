"""Finding tool calls in an assistant turn, as registry entries keyed by format name.

A parser never raises on model output: a call it cannot read becomes a :class:`MalformedCall`
that the executor answers with an error message, so the model learns from its mistake.

- ``qwen`` (Qwen2.5 / Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  strict JSON; ``arguments`` may also be a JSON-encoded string (as Qwen3's template renders it).
- ``hermes`` (Hermes 2 Pro and its fine-tunes): the same tags, also accepting Python-literal
  dicts (single quotes, True/None) that Hermes-style models often emit.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_ascend.errors import ConfigError, closest

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """A readable call: the tool's name, its arguments and the text it was parsed from."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclass(frozen=True)
class MalformedCall:
    """A call the model attempted but that could not be read; ``message`` explains why."""

    raw: str
    message: str
    name: str = "unknown"


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its text (outside the call tags) and its calls, in order."""

    content: str
    calls: list[ToolCall | MalformedCall] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        """Whether the turn attempted any call (well-formed or not): the rollout then continues."""
        return bool(self.calls)

    def assistant_message(self) -> dict[str, Any]:
        """The turn as a chat message with ``tool_calls`` (OpenAI/transformers shape), e.g. for samples."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        readable = [c for c in self.calls if isinstance(c, ToolCall)]
        if readable:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in readable
            ]
        return message


ToolCallParser = Callable[[str], ParsedTurn]
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {}


def register_tool_call_parser(name: str) -> Callable[[ToolCallParser], ToolCallParser]:
    """Decorator adding a parser ``text -> ParsedTurn`` to :data:`TOOL_CALL_PARSERS`."""

    def decorator(fn: ToolCallParser) -> ToolCallParser:
        if name in TOOL_CALL_PARSERS:
            raise ConfigError(f"a tool-call parser named {name!r} is already registered")
        TOOL_CALL_PARSERS[name] = fn
        return fn

    return decorator


def get_tool_call_parser(name: str) -> ToolCallParser:
    if name not in TOOL_CALL_PARSERS:
        raise ConfigError(
            f"unknown tool-call format {name!r}{closest(name, TOOL_CALL_PARSERS)}; "
            f"expected one of {sorted(TOOL_CALL_PARSERS)}"
        )
    return TOOL_CALL_PARSERS[name]


def parse_tool_calls(text: str, parser: str = "qwen") -> ParsedTurn:
    """Parse one assistant turn's text with the named format."""
    return get_tool_call_parser(parser)(text)


_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)


def _tagged_blocks(text: str) -> tuple[str, list[tuple[str, bool]]]:
    """Text outside ``<tool_call>`` blocks, and each block's body with whether it was closed."""
    blocks = []
    outside = []
    last = 0
    for m in _BLOCK.finditer(text):
        outside.append(text[last : m.start()])
        closed = text[m.start() : m.end()].endswith(TOOL_CALL_CLOSE)
        blocks.append((m.group(1), closed))
        last = m.end()
    outside.append(text[last:])
    return "".join(outside).strip(), blocks


def _call_from_object(obj: Any, raw: str, decode: Callable[[str], Any]) -> ToolCall | MalformedCall:
    if not isinstance(obj, dict):
        return MalformedCall(
            raw,
            f'a tool call must be an object {{"name": ..., "arguments": {{...}}}}; got {type(obj).__name__}',
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(raw, 'the tool call has no "name" string')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = decode(arguments) if arguments.strip() else {}
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the model's, reported back to it
            return MalformedCall(
                raw, f'"arguments" of {name!r} is a string that is not a JSON object ({exc})', name
            )
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return MalformedCall(
            raw, f'"arguments" of {name!r} must be an object; got {type(arguments).__name__}', name
        )
    return ToolCall(name, arguments, raw)


def _parse_tagged(text: str, decode: Callable[[str], Any]) -> ParsedTurn:
    content, blocks = _tagged_blocks(text)
    calls: list[ToolCall | MalformedCall] = []
    for body, closed in blocks:
        raw = body.strip()
        if not closed:
            calls.append(MalformedCall(raw, f"the tool call is not closed with {TOOL_CALL_CLOSE}"))
            continue
        try:
            obj = decode(raw)
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the model's, reported back to it
            calls.append(MalformedCall(raw, f"the tool call is not valid JSON ({exc})"))
            continue
        calls.append(_call_from_object(obj, raw, decode))
    return ParsedTurn(content, calls)


def _strict_json(text: str) -> Any:
    return json.loads(text)


def _json_or_python_literal(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return ast.literal_eval(text)


@register_tool_call_parser("qwen")
def parse_qwen(text: str) -> ParsedTurn:
    """Qwen2.5 / Qwen3 ``<tool_call>`` blocks holding strict JSON."""
    return _parse_tagged(text, _strict_json)


@register_tool_call_parser("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Hermes-style ``<tool_call>`` blocks holding JSON or a Python-literal dict."""
    return _parse_tagged(text, _json_or_python_literal)
