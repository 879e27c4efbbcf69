"""Running the tool calls of all rows at once, each with a timeout; every outcome is a result.

Nothing a tool does raises here: an unknown tool, arguments that do not fit its schema, an
exception or a timeout each become a :class:`ToolResult` whose ``content`` (the text returned to
the model) says what went wrong and whose ``failure`` names the reason for metrics.

Sync tools run in a thread pool and async tools on one private event loop, all concurrently. A
timed-out async tool is cancelled; a timed-out sync tool cannot be stopped from outside its thread
(Python has no thread kill), so it is abandoned and its thread stays busy until it returns. Tools
that may hang or misbehave belong in a subprocess, like the built-in sandboxed ``python`` tool,
which kills its process group at its own wall-clock limit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grpo_ascend.tools.content import tool_content
from grpo_ascend.tools.parsing import MalformedCall, ParsedTurn, ToolCall
from grpo_ascend.tools.toolset import Tool, Toolset

logger = logging.getLogger(__name__)

#: Why a call failed, as counted in metrics (``bad_output``: content blocks the model cannot take, such as an
#: image that cannot be decoded, or any image for a text-only model; tools/content.py).
FAILURE_REASONS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout", "bad_output")

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: ``content`` goes back to the model as the tool message (text, or content blocks
    whose image parts are bare ``{"type": "image"}``; ``images``: those images, decoded, in order)."""

    name: str
    content: str | list[dict[str, Any]]
    failure: str | None = None
    duration: float = 0.0
    truncated: bool = False
    images: tuple[Any, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failure is None

    def tool_message(self) -> dict[str, Any]:
        """The chat message (role ``tool``) the chat template renders as the response."""
        return {"role": "tool", "name": self.name, "content": self.content}


def _type_ok(value: Any, spec: dict[str, Any]) -> bool:
    types = spec.get("type")
    if value is None and spec.get("nullable"):
        return True  # Optional[...] arguments
    if types is None:
        return True
    names = types if isinstance(types, list) else [types]
    for name in names:
        allowed = _JSON_TYPES.get(name)
        if allowed is None:
            return True
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, allowed):
            return True
    return False


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """None when ``arguments`` fit the tool's schema (names, required, JSON types), else why not."""
    params = tool.parameters
    properties = params.get("properties", {})
    unknown = [k for k in arguments if k not in properties]
    if unknown:
        return (
            f"{tool.name}() got unexpected argument(s) {', '.join(map(repr, unknown))}; "
            f"its arguments are: {', '.join(properties) or '(none)'}"
        )
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"{tool.name}() is missing required argument(s) {', '.join(map(repr, missing))}"
    for key, value in arguments.items():
        spec = properties[key]
        if not _type_ok(value, spec):
            return f"{tool.name}() argument {key!r} must be of type {spec.get('type')}; got {type(value).__name__} {value!r:.80}"
    return None


class ToolExecutor:
    """Runs parsed calls concurrently. ``timeout`` (seconds) applies per call, ``max_output_chars``
    truncates each result (None: no limit; text blocks of a multimodal result each). ``takes_images``: the model
    reads images, so a tool may return image content blocks (tools/content.py). Its thread pool and event-loop thread start at the first
    :meth:`run`; :meth:`close` (or ``with``) stops them, and a later :meth:`run` starts them again."""

    def __init__(self, timeout: float = 30.0, max_output_chars: int | None = 4096, max_workers: int = 32,
                 takes_images: bool = False):
        self.timeout = timeout
        self.max_output_chars = max_output_chars
        self.takes_images = takes_images
        self._warned: set[str] = set()
        self.max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """True while the pool and the event-loop thread are up (between a run and close)."""
        return self._loop is not None

    def _start(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="grpo-tool")
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="grpo-tool-loop", daemon=True)
            self._thread.start()
        return self._loop

    def run(
        self, turns: Sequence[ParsedTurn], toolsets: Toolset | Sequence[Toolset]
    ) -> list[list[ToolResult]]:
        """The results of every call of every row, in call order: ``results[row][call]``.

        ``toolsets`` is one toolset for all rows or one per row (per-rollout environments).
        """
        if isinstance(toolsets, Toolset):
            toolsets = [toolsets] * len(turns)
        if len(toolsets) != len(turns):
            raise ValueError(f"got {len(turns)} turns but {len(toolsets)} toolsets; give one toolset per row")
        future = asyncio.run_coroutine_threadsafe(self._run_all(turns, toolsets), self._start())
        return future.result()

    async def _run_all(
        self, turns: Sequence[ParsedTurn], toolsets: Sequence[Toolset]
    ) -> list[list[ToolResult]]:
        jobs = [
            [self._run_one(call, toolset) for call in turn.calls] for turn, toolset in zip(turns, toolsets)
        ]
        flat = await asyncio.gather(*(job for row in jobs for job in row))
        out, i = [], 0
        for row in jobs:
            out.append(list(flat[i : i + len(row)]))
            i += len(row)
        return out

    async def _run_one(self, call: ToolCall | MalformedCall, toolset: Toolset) -> ToolResult:
        if isinstance(call, MalformedCall):
            return ToolResult(call.name, f"Error: malformed tool call: {call.message}", "malformed")
        tool = toolset.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"Error: {toolset.unknown_message(call.name)}", "unknown_tool")
        problem = check_arguments(tool, call.arguments)
        if problem is not None:
            return ToolResult(call.name, f"Error: bad arguments: {problem}", "bad_arguments")
        start = time.perf_counter()
        try:
            if tool.is_async:
                awaitable = tool.function(**call.arguments)
            else:
                awaitable = asyncio.get_running_loop().run_in_executor(
                    self._pool, functools.partial(tool.function, **call.arguments)
                )
            value = await asyncio.wait_for(awaitable, self.timeout)
        except (asyncio.TimeoutError, TimeoutError):
            return ToolResult(
                call.name,
                f"Error: {call.name} timed out after {self.timeout:g} s",
                "timeout",
                time.perf_counter() - start,
            )
        except Exception as exc:  # noqa: BLE001 - a tool's exception is reported to the model, never raised
            message = f"Error: {call.name} raised {type(exc).__name__}: {exc}"
            return ToolResult(call.name, message, "exception", time.perf_counter() - start)
        duration = time.perf_counter() - start
        out = tool_content(call.name, value, self.max_output_chars, self.takes_images)
        if out.problem is not None:
            if out.problem not in self._warned:  # once per distinct problem: the model is told every time
                self._warned.add(out.problem)
                logger.warning("%s", out.problem)
            return ToolResult(call.name, f"Error: {out.problem}", "bad_output", duration)
        return ToolResult(call.name, out.content, None, duration, out.truncated, out.images)

    def close(self) -> None:
        """Stop the event-loop thread and the thread pool (abandoned timed-out sync calls are not
        waited for); does nothing when not running."""
        loop, thread, pool = self._loop, self._thread, self._pool
        if loop is None:
            return
        self._loop = self._thread = self._pool = None
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
            assert thread is not None
            thread.join(timeout=5)
        if not loop.is_running():
            loop.close()
        assert pool is not None
        pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tool_metrics(results: Sequence[Sequence[ToolResult]]) -> dict[str, float]:
    """Per-round numbers for the metrics log: calls per row, failures by reason, tool time."""
    flat = [r for row in results for r in row]
    failures = Counter(r.failure for r in flat if r.failure is not None)
    metrics = {
        "tools/calls_per_completion": len(flat) / max(len(results), 1),
        "tools/failed_calls": float(sum(failures.values())),
        "tools/time_s": float(sum(r.duration for r in flat)),
        "tools/truncated": float(sum(r.truncated for r in flat)),
    }
    for reason in FAILURE_REASONS:
        metrics[f"tools/failed/{reason}"] = float(failures.get(reason, 0))
    return metrics
