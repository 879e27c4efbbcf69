"""How long vLLM's processes spin-wait on their shared-memory queues, for servers whose cores are shared.

vLLM 0.32 passes each engine step between its engine-core and worker processes through a shared-memory queue
whose reader, after every read, keeps polling with ``sched_yield`` for a second before it sleeps on a socket.
While a server samples, both processes therefore hold a core, the one waiting on the other too, and for a
second after: a CPU server beside the trainer takes the trainer's core (on 2 cores a 0.11 s training step took
0.64 s beside a sampling server, docs/async.md). Without the spin a reader wakes on a socket message instead,
tens of microseconds per engine step.

The window is ``GRPO_ASCEND_VLLM_BUSY_LOOP_S`` seconds when set; otherwise 0 on vLLM's CPU platform (whose cores
are the trainer's too) and vLLM's own elsewhere (an accelerator node has host cores to spare). Our server entry
point (serve.py) applies it in the server and in each process vLLM spawns.
"""

from __future__ import annotations

import functools
import os
import threading

from grpo_ascend.errors import ConfigError

#: The environment variable that sets the window (seconds); the server's spawned processes inherit it.
BUSY_LOOP_ENV = "GRPO_ASCEND_VLLM_BUSY_LOOP_S"

_lock = threading.Lock()
_patched = False
_window: float | None = None  # what readers made from now on use (None: vLLM's own)


def busy_loop_window() -> float | None:
    """The spin-wait window this process's vLLM should use (None: vLLM's own)."""
    value = os.environ.get(BUSY_LOOP_ENV, "").strip()
    if not value:
        from vllm.platforms import current_platform

        return 0.0 if current_platform.is_cpu() else None
    try:
        window = float(value)
    except ValueError:
        window = -1.0
    if not window >= 0:
        raise ConfigError(f"{BUSY_LOOP_ENV}={value!r} is not a number of seconds >= 0; set it to 0 (no spinning, "
                          "for cores shared with training) or 1 (vLLM's default), or unset it")
    return window


def prepare_vllm_polling() -> float | None:
    """Make the shared-memory queue readers this process creates from now on spin for :func:`busy_loop_window`
    seconds; returns that window (None: vLLM's own). Safe to call again (after the variable changed)."""
    global _patched, _window
    with _lock:
        _window = busy_loop_window()
        if not _patched:
            from vllm.distributed.device_communicators import shm_broadcast

            original = shm_broadcast.SpinCondition.__init__

            @functools.wraps(original)
            def init(self, is_reader, context, notify_address, busy_loop_s=1.0):  # noqa: ANN001, ANN202
                if is_reader and _window is not None:
                    busy_loop_s = _window
                original(self, is_reader, context, notify_address, busy_loop_s=busy_loop_s)

            shm_broadcast.SpinCondition.__init__ = init
            _patched = True
        return _window
