"""Tool calling: tools and environments, parsing calls from model output, running them, rendering
their responses, and the sandboxed ``python`` tool. The multi-turn rollout loop uses these as
``parse_tool_calls`` → ``ToolExecutor.run`` → ``render_tool_suffix``, together :func:`run_tool_step`."""

from grpo_ascend.tools.calculator import calculator
from grpo_ascend.tools.environments import (
    EnvironmentPool,
    RolloutEnvironment,
    append_observation,
    environment_methods,
    environment_toolset,
    load_environment_factory,
)
from grpo_ascend.tools.execution import (
    FAILURE_REASONS,
    ToolExecutor,
    ToolResult,
    check_arguments,
    tool_metrics,
)
from grpo_ascend.tools.parsing import (
    TOOL_CALL_PARSERS,
    MalformedCall,
    ParsedTurn,
    ToolCall,
    get_tool_call_parser,
    parse_tool_calls,
    register_tool_call_parser,
)
from grpo_ascend.tools.render import render_tool_suffix, render_tool_suffix_text
from grpo_ascend.tools.sandbox import SandboxLimits, SandboxResult, make_python_tool, run_python
from grpo_ascend.tools.toolset import (
    BUILTIN_TOOLS,
    Tool,
    Toolset,
    load_tool,
    load_toolset,
    tool_from_function,
)
from grpo_ascend.tools.turns import ToolStep, check_tool_chat_template, run_tool_step

__all__ = [
    "BUILTIN_TOOLS",
    "FAILURE_REASONS",
    "TOOL_CALL_PARSERS",
    "EnvironmentPool",
    "MalformedCall",
    "ParsedTurn",
    "RolloutEnvironment",
    "SandboxLimits",
    "SandboxResult",
    "Tool",
    "ToolCall",
    "ToolExecutor",
    "ToolResult",
    "ToolStep",
    "Toolset",
    "append_observation",
    "calculator",
    "check_arguments",
    "check_tool_chat_template",
    "environment_methods",
    "environment_toolset",
    "get_tool_call_parser",
    "load_environment_factory",
    "load_tool",
    "load_toolset",
    "make_python_tool",
    "parse_tool_calls",
    "register_tool_call_parser",
    "render_tool_suffix",
    "render_tool_suffix_text",
    "run_python",
    "run_tool_step",
    "tool_from_function",
    "tool_metrics",
]
