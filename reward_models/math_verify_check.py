"""LaTeX/symbolic answer equivalence with Math-Verify, each check bounded by a timeout.

Math-Verify (``pip install 'grpo-ascend[math]'``) parses LaTeX into sympy and compares values:
``\\frac{1}{2}`` = ``0.5``, ``\\{1,2\\}`` = ``\\{2,1\\}``, ``(x+1)^2`` = ``x^2+2x+1``, intervals, ``50\\%``.
Its own timeouts use ``signal.alarm``, which only works on a process's main thread, while reward
functions may run on worker threads (``reward_timeout``, async rewards). So the checks run in one
worker process (``_math_verify_worker.py``): each request waits at most ``timeout`` seconds, and a
check that runs over kills the worker (sympy cannot be interrupted otherwise), counts as "not
equal", and the next check starts a fresh worker. Only LaTeX extraction is enabled there, never
sympy's ``parse_expr``, so no completion text is evaluated as code.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from grpo_ascend.errors import ConfigError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'grpo-ascend[math]' (or pip install math-verify)"
#: The worker's program: a JSON line ``{"ready": true}`` once up, then one answer line per request line.
WORKER_SCRIPT = Path(__file__).with_name("_math_verify_worker.py")
_STARTUP_TIMEOUT = 120.0


def math_verify_available() -> bool:
    """Whether the ``math-verify`` package is installed."""
    return importlib.util.find_spec("math_verify") is not None


def require_math_verify(who: str = "accuracy") -> None:
    """ConfigError naming the extra to install when ``math-verify`` is missing."""
    if not math_verify_available():
        raise ConfigError(f"{who}: math_verify=true needs the math-verify package: {INSTALL_HINT}")


class MathVerifyChecker:
    """``equivalent(predicted, reference)`` through a Math-Verify worker process (thread-safe).

    Returns True/False, or None when the check ran past ``timeout`` seconds or Math-Verify raised
    (``timeouts`` and ``errors`` count those). The worker (``worker_script``, run with this Python) starts on
    the first check.
    """

    def __init__(self, timeout: float = 5.0, worker_script: str | os.PathLike = WORKER_SCRIPT) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"math_verify timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.worker_script = Path(worker_script)
        self.timeouts = 0
        self.errors = 0
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._lock = threading.Lock()
        atexit.register(self.close)

    @property
    def worker_process(self) -> subprocess.Popen | None:
        """The worker process last started (it may have died since); None before the first check that needs
        one and after :meth:`close`."""
        return self._proc

    def _start(self) -> subprocess.Popen:
        require_math_verify()
        proc = subprocess.Popen(
            [sys.executable, "-u", str(self.worker_script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._proc, self._buffer = proc, b""
        if self._read_line(time.monotonic() + _STARTUP_TIMEOUT) is None:
            self.close()
            raise RuntimeError(f"the Math-Verify worker did not start within {_STARTUP_TIMEOUT:.0f} s")
        return proc

    def _read_line(self, deadline: float) -> dict | None:
        """One JSON line from the worker, or None when the deadline passes or the worker died."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def equivalent(self, predicted: str, reference: str) -> bool | None:
        """Whether Math-Verify finds the two answers equal (None: timed out or failed)."""
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            assert proc.stdin is not None
            request = json.dumps({"predicted": predicted, "reference": reference}) + "\n"
            try:
                proc.stdin.write(request.encode())
                proc.stdin.flush()
            except BrokenPipeError:
                self.close()
                self.errors += 1
                return None
            answer = self._read_line(time.monotonic() + self.timeout)
            if answer is None:
                self.timeouts += 1
                logger.warning("Math-Verify check ran past %.1f s; counted as not equal (worker restarted): %r vs %r",
                               self.timeout, predicted[:80], reference[:80])
                self.close()
                return None
            if "error" in answer:
                self.errors += 1
                return None
            return bool(answer["equal"])

    def close(self) -> None:
        """Stop the worker (a later check starts a new one)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()
