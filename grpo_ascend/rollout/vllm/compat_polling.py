"""How long vLLM's processes spin-wait on their shared-memory queues, for servers whose cores are shared.

vLLM 0.32 passes each engine step between its engine-core and worker processes through a shared-memory queue
whose reader, after every read, keeps polling with ``sched_yield`` for a second before it sleeps on a socket.
While a server samples, both processes therefore hold a core, the one waiting on the other too, and for a
second after: a CPU server beside the trainer takes the trainer's core (on 2 cores a 0.11 s training step took
0.64 s beside a sampling server, docs/async.md). Without the spin a reader wakes on a socket message instead,
tens of microseconds per engine step.

A sleeping reader can miss its wake-up message (a socket message the writer sends after each write); vLLM
then finds the data at its next re-check, 5 s later (``SHM_READER_RECHECK_INTERVAL_MS``). Under vLLM's
1-second spin that is rare, as only the first step after a pause sleeps; without the spin every step sleeps, and
a tiny model's generate call took 5-20 s instead of 0.1-3 s. So wherever the window is ours, readers re-check
every :data:`RECHECK_MS` milliseconds: a lost message costs that, and an idle server wakes its two readers that
often (well under 1 % of a core).

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
#: How often a sleeping reader looks at the queue again when the window is ours (vLLM's own: 5,000).
RECHECK_MS = 10

_lock = threading.Lock()
_patched = False
_window: float | None = None  # what readers made from now on use (None: vLLM's own)
_vllm_recheck_ms = 5000  # vLLM's own re-check interval, read when the module is first patched


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
    seconds (and re-check every :data:`RECHECK_MS` ms when asleep, where the window is ours); returns that window
    (None: vLLM's own). Safe to call again (after the variable changed)."""
    global _patched, _window, _vllm_recheck_ms
    from vllm.distributed.device_communicators import shm_broadcast

    with _lock:
        _window = busy_loop_window()
        if not _patched:
            original = shm_broadcast.SpinCondition.__init__

            @functools.wraps(original)
            def init(self, is_reader, context, notify_address, busy_loop_s=1.0):  # noqa: ANN001, ANN202
                if is_reader and _window is not None:
                    busy_loop_s = _window
                original(self, is_reader, context, notify_address, busy_loop_s=busy_loop_s)

            shm_broadcast.SpinCondition.__init__ = init
            _vllm_recheck_ms = shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS
            _patched = True
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = _vllm_recheck_ms if _window is None else RECHECK_MS
        return _window
