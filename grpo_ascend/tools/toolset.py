"""Tools as plain Python functions: their JSON schema, a name → tool mapping, and loading from specs.

A tool is a sync or async function with type hints and a Google-style docstring (TRL's convention);
its schema comes from transformers' ``get_json_schema`` and is what the chat template renders in the
system prompt. Recipes name tools as ``module:function``, ``path/to/file.py:function`` or a built-in
name (``python``, ``calculator``), optionally as a mapping with options: ``{name: python, timeout: 5}``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from grpo_ascend.errors import ConfigError, closest
from grpo_ascend.tools.calculator import make_calculator_tool
from grpo_ascend.tools.sandbox import make_python_tool
from grpo_ascend.user_code import load_object

ToolFunction = Callable[..., Any]

_HOW_TO = (
    "a tool needs a type hint on every argument and a Google-style docstring with an 'Args:' section "
    "describing each argument, e.g.\n"
    "    def add(a: int, b: int) -> int:\n"
    '        """Add two integers.\n\n'
    "        Args:\n"
    "            a: The first integer.\n"
    "            b: The second integer.\n"
    '        """'
)


@dataclass(frozen=True)
class Tool:
    """One callable tool: its name (the function's), the function and its JSON schema."""

    name: str
    function: ToolFunction
    schema: dict[str, Any]

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the arguments (``{"type": "object", "properties": ..., "required": ...}``)."""
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})


def tool_from_function(fn: ToolFunction) -> Tool:
    """A :class:`Tool` for ``fn``; ConfigError naming the function and what is missing when its type
    hints or docstring cannot be turned into a schema."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ConfigError(f"a tool must be a function; got {type(fn).__name__} {fn!r}")
    label = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if not inspect.isfunction(fn) and not inspect.ismethod(fn):
        raise ConfigError(
            f"tool {label!r} is a {type(fn).__name__}; tools must be plain functions or bound methods "
            "(wrap a callable object in a def with a docstring)"
        )
    try:
        schema = get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise ConfigError(f"tool {label!r} cannot be described to the model: {exc}.\n{_HOW_TO}") from exc
    return Tool(name=schema["function"]["name"], function=fn, schema=schema)


class Toolset:
    """Tools by name, in the order added; ``schemas`` is what ``apply_chat_template(tools=...)`` takes."""

    def __init__(self, tools: Iterable[ToolFunction | Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for fn in tools:
            self.add(fn)

    def add(self, fn: ToolFunction | Tool) -> Tool:
        """Add a function (schema derived from it) or a ready :class:`Tool`; names must be unique."""
        tool = tool_from_function(fn)
        if tool.name in self._tools:
            raise ConfigError(
                f"two tools are named {tool.name!r}; tool names must be unique (rename one of the functions)"
            )
        self._tools[tool.name] = tool
        return tool

    def merged(self, other: Toolset | Iterable[ToolFunction | Tool]) -> Toolset:
        """A new toolset with this one's tools followed by ``other``'s."""
        out = Toolset(self._tools.values())
        for tool in other:
            out.add(tool)
        return out

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self._tools.values()]

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def unknown_message(self, name: str) -> str:
        """The error text for a call to a tool that does not exist here."""
        available = ", ".join(self._tools) or "(none)"
        return f"unknown tool {name!r}{closest(name, self._tools)}; available tools: {available}"

    def __getitem__(self, name: str) -> Tool:
        if name not in self._tools:
            raise KeyError(self.unknown_message(name))
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __repr__(self) -> str:
        return f"Toolset({', '.join(self._tools)})"


def _python_tool(**options: Any) -> ToolFunction:

    return make_python_tool(**options)


def _calculator_tool(**options: Any) -> ToolFunction:

    return make_calculator_tool(**options)


#: Built-in tools by name; each value is a factory called with the spec's options returning a function.
BUILTIN_TOOLS: dict[str, Callable[..., ToolFunction]] = {"python": _python_tool, "calculator": _calculator_tool}

_TOOL_FORMS = "a function, 'module:function', 'path/to/file.py:function', a built-in name ({names}), or {{name: ..., option: value}}"


def load_tool(spec: str | Mapping[str, Any] | ToolFunction, **options: Any) -> ToolFunction:
    """Resolve one tool spec to a function (see the module docstring for the forms)."""
    forms = _TOOL_FORMS.format(names=", ".join(sorted(BUILTIN_TOOLS)))
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise ConfigError(
                f"a tool given as a mapping needs a 'name' key ({forms}); got keys {sorted(spec)}"
            )
        merged = {k: v for k, v in spec.items() if k != "name"}
        merged.update(options)
        return load_tool(spec["name"], **merged)
    if callable(spec):
        if options:
            raise ConfigError(f"options {sorted(options)} only apply to built-in tools, not to {spec!r}")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"a tool must be {forms}; got {spec!r}")
    text = spec.strip()
    if text in BUILTIN_TOOLS:
        factory = BUILTIN_TOOLS[text]
        try:
            return factory(**options)
        except TypeError as exc:
            raise ConfigError(f"bad options {sorted(options)} for the built-in tool {text!r}: {exc}") from exc
    if ":" in text:
        if options:
            raise ConfigError(f"options {sorted(options)} only apply to built-in tools, not to {text!r}")
        return load_object(text, "tool")
    raise ConfigError(f"unknown tool {text!r}{closest(text, BUILTIN_TOOLS)}; a tool is {forms}")


def load_toolset(specs: Iterable[str | Mapping[str, Any] | ToolFunction] | None) -> Toolset:
    """A :class:`Toolset` from a list of tool specs (as in a recipe's ``tools:``); None gives an empty one."""
    if specs is None:
        return Toolset()
    if isinstance(specs, (str, Mapping)) or callable(specs):
        specs = [specs]
    return Toolset(load_tool(s) for s in specs)
