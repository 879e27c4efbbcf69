"""Requests spread over several vLLM servers, answers reassembled in order, dead servers dropped (and taken
back by the client once they answer again: :meth:`ServerPool.readmit`).

:meth:`ServerPool.map` sends jobs (one prompt's group each) to the live servers by an affinity key
(``key % live servers``: a group stays on one server, and a multi-turn row goes back to the server
whose prefix cache holds its context), at most ``per_server`` at a time on each, and returns the
answers in the jobs' order. A server whose call raises :class:`ServerGone` is dropped with one
warning line and the jobs it had not answered go to the others; when none is left the pool raises
:class:`ServerGone` (a :class:`~grpo_ascend.errors.RolloutError`). :meth:`ServerPool.broadcast` runs
a call on every live server (weight sync). The transport is the caller's ``call(url, job)``, so the
logic runs without a server (tests use a fake).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.vllm.server_http import RESUME_HINT, ServerGone

logger = logging.getLogger(__name__)

J = TypeVar("J")
R = TypeVar("R")


def server_urls(value: str | Sequence[str]) -> list[str]:
    """``vllm_server_base_url`` as a list of URLs: one URL, a comma-separated string, or a list."""
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = [str(u).strip().rstrip("/") for u in items if str(u).strip()]
    if not urls:
        raise ConfigError(f"vllm_server_base_url={value!r} names no server; give a URL such as "
                          "http://host:8000, or a list of them")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"vllm_server_base_url entry {url!r} is not an http(s) URL; write it as http://host:port")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"vllm_server_base_url lists a server twice: {urls}; give each server once")
    return urls


class ServerPool(Generic[J, R]):
    """The live servers among ``urls``; see the module docstring. Safe to use from several threads."""

    def __init__(self, urls: Sequence[str], per_server: int = 8) -> None:
        self.urls = list(urls)
        self.per_server = max(1, int(per_server))
        self._live = list(self.urls)
        self._lock = threading.Lock()
        self._slots = {u: threading.Semaphore(self.per_server) for u in self.urls}
        self._last_error: dict[str, str] = {}

    @property
    def live(self) -> list[str]:
        """The servers still in use, in their configured order; :class:`ServerGone` when none is."""
        with self._lock:
            live = list(self._live)
        if not live:
            raise ServerGone(self._gone_message())
        return live

    @property
    def dropped(self) -> list[str]:
        """The servers dropped so far, in their configured order."""
        with self._lock:
            return [u for u in self.urls if u not in self._live]

    def readmit(self, url: str) -> None:
        """Use ``url`` again (a dropped server that answers again, brought up to date by the caller)."""
        with self._lock:
            if url in self._live:
                return
            self._live = [u for u in self.urls if u in self._live or u == url]
            live = len(self._live)
        logger.warning("vLLM server %s is back; %d of %d servers in use", url, live, len(self.urls))

    def drop(self, url: str, why: str) -> None:
        """Stop using ``url`` (one warning line, the first time)."""
        with self._lock:
            if url not in self._live:
                return
            self._live.remove(url)
            self._last_error[url] = why
            left = len(self._live)
        if left:
            logger.warning("vLLM server %s dropped (%s); %d of %d servers left, its requests go to the others",
                           url, why, left, len(self.urls))

    def map(self, call: Callable[[str, J], R], jobs: Sequence[J], keys: Sequence[int] | None = None) -> list[R]:
        """``call(url, job)`` for every job on the live servers, answers in the jobs' order."""
        keys = list(range(len(jobs))) if keys is None else list(keys)
        results: list[R | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))
        while pending:
            live = self.live
            where = {i: live[keys[i] % len(live)] for i in pending}
            pending = self._round(call, jobs, where, results)
        return results  # type: ignore[return-value]

    def _round(self, call: Callable[[str, J], R], jobs: Sequence[J], where: dict[int, str],
               results: list[R | None]) -> list[int]:
        """One pass of the jobs ``where`` places; the jobs whose server was dropped (to place again)."""
        failed: list[int] = []

        def run(i: int) -> None:
            url = where[i]
            try:
                if url not in self._live:
                    raise ServerGone(f"the vLLM server at {url} was dropped", "dropped")
                with self._slots[url]:
                    results[i] = call(url, jobs[i])
            except ServerGone as err:
                self.drop(url, err.reason)
                failed.append(i)

        workers = min(len(where), self.per_server * len(set(where.values())))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm-request") as pool:
            for future in [pool.submit(run, i) for i in where]:
                future.result()
        return sorted(failed)

    def broadcast(self, call: Callable[[str], object]) -> None:
        """``call(url)`` on every live server at once; a server that is gone is dropped (none left: ServerGone)."""
        live = self.live

        def run(url: str) -> None:
            try:
                call(url)
            except ServerGone as err:
                self.drop(url, err.reason)

        with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="vllm-broadcast") as pool:
            for future in [pool.submit(run, u) for u in live]:
                future.result()
        self.live  # noqa: B018 - raises when every server is gone

    def _gone_message(self) -> str:
        if len(self.urls) == 1:
            url = self.urls[0]
            return (f"the vLLM server at {url} stopped answering ({self._last_error.get(url, 'no answer')}); "
                    f"{RESUME_HINT}")
        errors = "; ".join(f"{u}: {self._last_error.get(u, 'no answer')}" for u in self.urls)
        return (f"every vLLM server stopped answering ({errors}); restart them and resume from the last checkpoint "
                "(resume_from_checkpoint=True)")

