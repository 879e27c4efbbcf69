"""A weight load running on a thread of its own, with a deadline, that whoever needs it done waits on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from grpo_ascend.errors import RolloutError


class PendingLoad:
    """Runs ``work()`` on a daemon thread at once; :meth:`wait` returns when it is done, re-raises what it raised,
    and raises ``RolloutError(timeout_error)`` once ``timeout`` seconds have passed since the start, so a caller
    never hangs on a sampler that stopped answering. Any number of threads may wait."""

    def __init__(self, work: Callable[[], None], *, timeout: float, timeout_error: str) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout_error = timeout_error
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name="vllm-weight-sync")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # handed to the waiting threads
            self._error = exc

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Return once the work is done; its exception, or RolloutError past the deadline."""
        self._thread.join(max(self.deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            raise RolloutError(self.timeout_error)
        if self._error is not None:
            raise self._error
