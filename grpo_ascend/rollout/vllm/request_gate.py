"""Requests to the vLLM servers held back while full weights are overwritten in place.

A full-weight load replaces a server's parameters in place: a request in flight during it would sample some
tokens with one version and the rest with the next. The server runs a load between two engine steps, which keeps
each step whole but not each request, so the client keeps versions exact itself: every request runs inside
:meth:`RequestGate.request`, a full-weight load inside :meth:`RequestGate.exclusive`, which waits for the requests
in flight to end and holds new ones until the load is done (a waiting load goes first: new requests do not
starve it). Adapter versions need no gate: each is loaded under a new name beside the old one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class RequestGate:
    """Many requests at once, or one full-weight load alone; see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requests = 0
        self._loading = False
        self._loads_waiting = 0

    @property
    def in_flight(self) -> int:
        """Requests inside the gate now."""
        with self._cond:
            return self._requests

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        """Hold the weights still while one request runs (waits while a load runs or waits)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._loading and not self._loads_waiting)
            self._requests += 1
        try:
            yield
        finally:
            with self._cond:
                self._requests -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run a full-weight load once no request is in flight; new requests wait until it is done."""
        with self._cond:
            self._loads_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._loading and self._requests == 0)
            finally:
                self._loads_waiting -= 1
            self._loading = True
        try:
            yield
        finally:
            with self._cond:
                self._loading = False
                self._cond.notify_all()
