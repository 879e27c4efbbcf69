"""One tool step of a batch of rollouts: parse each finished turn, run every call, render the suffix.

This is the single call the multi-turn rollout loop makes each time some rows end an assistant
turn at EOS: rows whose turn has calls get the tokens to prefill next (tool responses plus the next
assistant header); rows without calls are finished.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_ascend.errors import ConfigError
from grpo_ascend.tools.execution import ToolExecutor, ToolResult
from grpo_ascend.tools.parsing import ParsedTurn, get_tool_call_parser
from grpo_ascend.tools.render import render_tool_suffix
from grpo_ascend.tools.toolset import Toolset


@dataclass(frozen=True)
class ToolStep:
    """A row's outcome: its parsed turn, the call results (in call order) and the token ids to append
    (empty when the turn made no call: the rollout is finished)."""

    turn: ParsedTurn
    results: list[ToolResult]
    suffix_ids: list[int]

    @property
    def continues(self) -> bool:
        return bool(self.suffix_ids)

    def messages(self) -> list[dict[str, Any]]:
        """The turn and its tool responses as chat messages (for samples.jsonl)."""
        return [self.turn.assistant_message(), *(r.tool_message() for r in self.results)]


def run_tool_step(
    turn_texts: Sequence[str],
    toolsets: Toolset | Sequence[Toolset],
    executor: ToolExecutor,
    tokenizer: Any,
    parser: str = "qwen",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[ToolStep]:
    """Parse ``turn_texts`` (each row's last assistant turn, decoded without skipping special tokens
    or with the tool tags kept), run all calls of all rows concurrently and render each suffix."""
    parse = get_tool_call_parser(parser)
    turns = [parse(text) for text in turn_texts]
    results = executor.run(turns, toolsets)
    return [
        ToolStep(turn, row, render_tool_suffix(tokenizer, row, chat_template_kwargs) if row else [])
        for turn, row in zip(turns, results)
    ]


def check_tool_chat_template(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
    """ConfigError unless the tokenizer's chat template renders a whole tool conversation: the tool
    schemas, the assistant's call and the tool's response (what TRL calls ``supports_tool_calling``)."""

    def probe_tool(value: str) -> str:
        """Probe tool.

        Args:
            value: A value.
        """
        return value

    conversation = [
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "probe_tool", "arguments": {"value": "7q1"}}}
            ],
        },
        {"role": "tool", "name": "probe_tool", "content": "9z4"},
    ]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=[probe_tool], tokenize=False, **dict(chat_template_kwargs or {})
        )
    except Exception as exc:  # noqa: BLE001 - any template failure means the same thing here
        raise ConfigError(
            f"the chat template cannot render tool calls ({type(exc).__name__}: {exc})"
        ) from exc
    missing = [
        what
        for what, mark in (("tool schemas", "Probe tool."), ("tool calls", "7q1"), ("tool responses", "9z4"))
        if mark not in text
    ]
    if missing:
        raise ConfigError(
            f"the chat template does not render {', '.join(missing)}; tool calling needs a template that renders "
            "the `tools` list, assistant `tool_calls` and `tool` messages (e.g. Qwen2.5's)"
        )
