"""Running one reward call under ``reward_timeout``: a sync function in a daemon worker thread (which
cannot be killed: a timed-out one keeps running, its result discarded), an async one on the process's
background event loop, where it is cancelled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from reward_models.loading import reward_name


class _Timeout(Exception):
    """A reward call ran past ``reward_timeout``."""


# One background event loop per process for async reward functions: it works even when the caller
# is itself inside a running loop (Jupyter), and clients an async function caches (HTTP sessions)
# stay bound to the same loop across calls.
_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop.is_closed() or _loop_pid != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="reward-models-async", daemon=True).start()
            _loop, _loop_pid = loop, os.getpid()
        return _loop


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _is_async(fn: Any) -> bool:
    """True for ``async def`` functions, partials of them, and objects with an ``async def __call__``."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = None if inspect.isfunction(fn) else inspect.getattr_static(type(fn), "__call__", None)
    return call is not None and inspect.iscoroutinefunction(call)


def _call_sync(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float | None) -> Any:
    """``fn(**kwargs)``, in a daemon worker thread when ``timeout`` is set (_Timeout past it); a returned
    awaitable is run on the background loop under the same limit."""
    if timeout is None:
        out = fn(**kwargs)
    else:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(**kwargs)
            except BaseException as exc:  # re-raised in the calling thread
                box["error"] = exc

        worker = threading.Thread(target=target, name=f"reward-{reward_name(fn)}", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise _Timeout()
        if "error" in box:
            raise box["error"]
        out = box["value"]
    if inspect.isawaitable(out):  # a sync-looking callable that returned a coroutine
        future = asyncio.run_coroutine_threadsafe(_await(out), _background_loop())
        try:
            out = future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise _Timeout() from None
    return out


async def _call_async(fn: Callable[..., Any], kwargs: dict[str, Any], timeout: float | None) -> Any:
    """``await fn(**kwargs)`` on the running loop, cancelled with _Timeout past ``timeout``."""
    out = fn(**kwargs)
    if not inspect.isawaitable(out):
        return out
    task = asyncio.ensure_future(out)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        raise _Timeout()
    return task.result()
