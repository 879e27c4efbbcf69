"""Weights to vLLM servers over a process group per server, not through files (``weight_transfer``): full weights
and LoRA adapter versions alike.

At start, :func:`resolve_transfer` asks every server whether it can join a transfer group (our entry point
``python -m grpo_ascend.rollout.vllm.serve`` can; vLLM's own cannot): ``collective`` refuses a server that cannot
with one ConfigError line, ``auto`` falls back to files with one log line saying why and how to enable it.

:class:`CollectiveSync` then builds one :class:`~grpo_ascend.weight_transfer.group.TransferGroup` per server at the
first sync (the trainer is rank 0, the server's workers ``1..W``), reuses it for every sync and tears it down on
close. A sync plans a manifest of the policy's tensors (the server's dtype on the wire), asks every server to
receive it (an HTTP call on a thread per server: the server's workers receive while the trainer broadcasts) and
broadcasts the buckets. A server whose call or broadcast fails (it died, or did not answer within half of the
sync's timeout) is reported back to be dropped while the others finish; its group is closed, so a restarted
server joins a new one. The server resets its prefix cache after each load (transfer_routes.py).

An adapter version (:meth:`CollectiveSync.send_adapter`) travels the same way into the workers' memory, where vLLM's
LoRA manager loads it by the name :func:`adapter_path` gives (adapter_memory.py): no adapter folder is written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grpo_ascend import device as dev
from grpo_ascend.errors import ConfigError, RolloutError
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.vllm.server_http import ServerError, ServerGone
from grpo_ascend.weight_transfer.group import TransferGroup, address_towards
from grpo_ascend.weight_transfer.manifest import Manifest, dtype_of
from grpo_ascend.weight_transfer.sender import SendReport, WeightSender
from grpo_ascend.weight_transfer.settings import default_bucket_bytes

logger = logging.getLogger(__name__)

#: The name our engine has in vLLM's weight-transfer registry.
ENGINE_NAME = "grpo_ascend"
#: The routes our entry point mounts (transfer_routes.py).
PROBE_PATH = "/grpo/weight_transfer"
JOIN_PATH = f"{PROBE_PATH}/join"
RECEIVE_PATH = f"{PROBE_PATH}/receive"
LEAVE_PATH = f"{PROBE_PATH}/leave"
ADAPTER_PATH = f"{PROBE_PATH}/adapter"
FORGET_ADAPTER_PATH = f"{PROBE_PATH}/forget_adapter"
ECHO_PATH = f"{PROBE_PATH}/echo"
#: The ``lora_path`` of an adapter a server's workers received over their group (not a folder).
ADAPTER_SCHEME = "grpo-transfer://"
#: How to start a server that can join.
ENABLE_HINT = ("start the server with `python -m grpo_ascend.rollout.vllm.serve --model BASE ...` (vLLM's server "
               "with our weight-transfer engine)")

#: The output head's name where it is tied to the embeddings: vLLM's loaders skip it then, so it is not sent.
TIED_HEAD_NAMES = frozenset({"lm_head.weight"})

#: ``request(url, method, path, body, timeout=..., retries=...)``: the client's JSON request.
Request = Callable[..., Any]


@dataclass(frozen=True)
class ServerEnd:
    """What a server that can join told the probe: its workers, their device type, the model's dtype, whether its
    head is tied to the embeddings."""

    workers: int
    device_type: str
    dtype: torch.dtype
    tied_head: bool = False


def probe(request: Request, url: str, device: torch.device | str) -> ServerEnd | str:
    """The server's end of a transfer group, or why it cannot join one with a trainer on ``device``."""
    try:
        answer = request(url, "GET", PROBE_PATH, timeout=10.0, retries=0)
    except ServerError as err:
        return f"it has no {PROBE_PATH} route ({str(err).splitlines()[0][:120]}): not our entry point"
    except ServerGone as err:
        return f"it did not answer {PROBE_PATH} ({err.reason})"
    if not isinstance(answer, dict) or answer.get("engine") != ENGINE_NAME:
        return f"its {PROBE_PATH} answered {str(answer)[:120]!r}, not our engine"
    kind, ours = str(answer.get("device_type", "cpu")), dev.device_type(device)
    if dev.transfer_backend(kind) != dev.transfer_backend(ours):
        return (f"its workers are on {kind} and the trainer on {ours}: no collective backend joins the two "
                f"({dev.transfer_backend(kind)} vs {dev.transfer_backend(ours)})")
    return ServerEnd(int(answer["workers"]), kind, dtype_of(str(answer.get("dtype", "float32"))),
                     bool(answer.get("tied_head", False)))


def resolve_transfer(mode: str, request: Request, urls: Sequence[str],
                     device: torch.device | str) -> dict[str, ServerEnd] | None:
    """The servers' ends when full weights go over groups (``mode`` collective, or auto where every server can
    join); None for files (see the module docstring)."""
    if mode == "files":
        return None
    ends, why = {}, {}
    for url in urls:
        found = probe(request, url, device)
        if isinstance(found, ServerEnd):
            ends[url] = found
        else:
            why[url] = found
    if not why:
        return ends
    url, reason = next(iter(why.items()))
    if mode == "collective":
        raise ConfigError(f"weight_transfer='collective' needs every vLLM server to join a transfer group, but the "
                          f"one at {url} cannot ({reason}); {ENABLE_HINT}, or set weight_transfer: files")
    logger.warning("weight_transfer=auto: full weights go to the vLLM servers through files in vllm_sync_dir because "
                   "the server at %s cannot join a transfer group (%s); for a process group instead, %s", url, reason,
                   ENABLE_HINT)
    return None


def adapter_path(name: str) -> str:
    """The ``lora_path`` vLLM's ``/v1/load_lora_adapter`` is given for the adapter received as ``name``."""
    return ADAPTER_SCHEME + name


class CollectiveSync:
    """One transfer group per server, built at its first sync; see the module docstring.

    ``timeout_s``: the sync's timeout; a server is given half of it (to join, to take the buckets), so the others
    finish within the whole. ``host``: the address the servers' workers reach the trainer at (None: this machine's
    address on the route to each server). ``checksums``: keep the servers' checksums of what they received
    (:attr:`last_checksums`, a check that the bytes arrived whole)."""

    def __init__(self, request: Request, ends: dict[str, ServerEnd], device: torch.device | str, timeout_s: float,
                 bucket_bytes: int | None = None, host: str | None = None, checksums: bool = False) -> None:
        self.request = request
        self.ends = dict(ends)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = bucket_bytes
        self.host = host
        self.checksums = checksums
        self.sender = WeightSender(self.device)
        self.groups: dict[str, TransferGroup] = {}
        self.last_report: SendReport | None = None
        self.last_checksums: dict[str, list[dict[str, str]]] = {}

    @property
    def per_server_timeout(self) -> float:
        return self.timeout_s / 2

    def plan(self, weights: PolicyWeights, wire: torch.dtype | None, tied_head: bool = False) -> Manifest:
        """The sync's manifest: floating tensors in ``wire`` (the servers' dtype; None: as trained), without the
        output head when ``tied_head`` (the servers' loaders skip it; its values are the embeddings')."""
        specs = [(name, wire if wire is not None and dtype.is_floating_point else dtype, shape)
                 for name, dtype, shape in weights.tensor_specs() if not (tied_head and name in TIED_HEAD_NAMES)]
        size = self.bucket_bytes
        if size is None:
            largest = max((torch.empty((), dtype=d).element_size() * _numel(s) for _, d, s in specs), default=0)
            size = default_bucket_bytes(self.device, largest)
        return Manifest.plan(specs, size)

    def join(self, url: str) -> None:
        """Build ``url``'s group: its workers join over HTTP (a thread) while this rank builds its side."""
        end = probe(self.request, url, self.device)  # again: a restarted server may be another one
        if isinstance(end, str):
            raise RolloutError(f"it cannot join a transfer group ({end})")
        self.ends[url] = end
        store, address = TransferGroup.listen(1 + end.workers, self.per_server_timeout,
                                              advertise=self.host or address_towards(url))
        body = {"init_info": {"address": address.to_json(), "timeout_s": self.per_server_timeout}}
        joined = _Call(lambda: self.request(url, "POST", JOIN_PATH, body, timeout=self.per_server_timeout,
                                            retries=0))
        try:
            group = TransferGroup.build(store, address, 0, self.device, self.per_server_timeout)
        except RolloutError as err:
            joined.wait(1.0)
            raise RolloutError(joined.error or str(err)) from None
        joined.wait(self.per_server_timeout)
        if joined.error is not None:
            group.close()
            raise RolloutError(joined.error)
        self.groups[url] = group

    def send(self, urls: Sequence[str], weights: PolicyWeights) -> dict[str, str]:
        """Load ``weights`` into the servers at ``urls``; the servers that failed, each with why (their groups
        closed: the caller drops them)."""
        failed = self._join_all(urls)
        live = [u for u in urls if u in self.groups]
        if not live:
            return failed
        wires = {self.ends[u].dtype for u in live}
        manifest = self.plan(weights, wires.pop() if len(wires) == 1 else None,
                             tied_head=all(self.ends[u].tied_head for u in live))
        names = {t.name for t in manifest.tensors}
        body = {"version": None if weights.version is None else str(weights.version)}
        tensors = ((name, t) for name, t in weights.named_tensors() if name in names)
        failed.update(self._broadcast(live, RECEIVE_PATH, body, manifest, tensors, "loading the weights"))
        return failed

    def send_adapter(self, urls: Sequence[str], name: str, config: dict[str, Any],
                     tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """Put the adapter ``name`` (PEFT ``config``, PEFT-named ``tensors`` as trained) into the workers' memory on
        the servers at ``urls``; vLLM then loads it from :func:`adapter_path` ``(name)``. The servers that failed,
        each with why (their groups closed)."""
        failed = self._join_all(urls)
        live = [u for u in urls if u in self.groups]
        if not live:
            return failed
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors]
        size = self.bucket_bytes or default_bucket_bytes(
            self.device, max((t.numel() * t.element_size() for _, t in tensors), default=0))
        manifest = Manifest.plan(specs, size)
        body = {"lora_name": name, "config": _json_config(config)}
        failed.update(self._broadcast(live, ADAPTER_PATH, body, manifest, iter(tensors), "receiving the adapter"))
        return failed

    def forget_adapter(self, urls: Sequence[str], name: str) -> None:
        """The workers at ``urls`` drop the adapter ``name`` from memory (vLLM unloaded it); a server that cannot
        answer has lost it already."""
        for url in urls:
            try:
                self.request(url, "POST", FORGET_ADAPTER_PATH, {"lora_name": name}, timeout=30.0, retries=0)
            except (ServerError, ServerGone) as err:
                logger.info("vLLM server %s did not drop the adapter %s: %s", url, name, _first_line(err))

    def round_trip(self, url: str, nbytes: int) -> dict[str, Any]:
        """One bucket of ``nbytes`` random bytes to the server's workers over its group and back (its first worker
        broadcasts what it received): seconds, bytes/s over both ways, whether it came back bit for bit."""
        if url not in self.groups:
            self.join(url)
        group = self.groups[url]
        sent = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        sent = sent.to(self.device)
        back = torch.empty_like(sent)
        call = _Call(lambda: self.request(url, "POST", ECHO_PATH, {"nbytes": nbytes}, timeout=self.per_server_timeout,
                                          retries=0))
        started = time.perf_counter()
        try:
            group.broadcast(sent).wait()
            dev.broadcast(group.group, back, 1).wait()
            dev.synchronize(self.device)
        except RuntimeError as err:
            call.wait(1.0)
            self.forget(url)
            raise RolloutError(f"the round trip to {url} failed: {call.error or _first_line(err)}") from None
        seconds = time.perf_counter() - started
        call.wait(self.per_server_timeout)
        if call.error is not None:
            raise RolloutError(f"the round trip to {url} failed: {call.error}")
        return {"bytes": nbytes, "round_trip_s": seconds, "bytes_per_s": 2 * nbytes / seconds,
                "bit_for_bit": bool(torch.equal(sent.cpu(), back.cpu())), "workers": self.ends[url].workers,
                "backend": dev.transfer_backend(self.device)}

    def _join_all(self, urls: Sequence[str]) -> dict[str, str]:
        """Join every server at ``urls`` without a group yet; those that could not, each with why."""
        failed: dict[str, str] = {}
        for url in urls:
            if url not in self.groups:
                try:
                    self.join(url)
                except (RolloutError, ServerError) as err:
                    failed[url] = f"could not join the weight-transfer group: {_first_line(err)}"
        return failed

    def _broadcast(self, live: Sequence[str], path: str, body: dict[str, Any], manifest: Manifest,
                   tensors: Iterator[tuple[str, torch.Tensor]], what: str) -> dict[str, str]:
        """Ask each server at ``live`` to receive ``manifest`` through ``path`` (``body`` besides the manifest) while
        this rank broadcasts ``tensors``; the servers that failed, each with why (their groups closed)."""
        failed: dict[str, str] = {}
        body = {**body, "update_info": {"manifest": manifest.to_json(), "checksums": self.checksums}}
        deadline = time.monotonic() + self.per_server_timeout + 1.0
        calls = {u: _Call(lambda u=u: self.request(u, "POST", path, body, timeout=self.per_server_timeout,
                                                   retries=0)) for u in live}
        report = self.sender.send(manifest, tensors, [self.groups[u] for u in live])
        self.last_report = report
        self.last_checksums = {}
        for i, url in enumerate(live):
            call = calls[url]
            call.wait(max(deadline - time.monotonic(), 0.1))
            if call.error is not None and call.error != _Call.NO_ANSWER:  # the server said why: the first cause
                failed[url] = f"{what} failed: {call.error}"
            elif i in report.failed:
                failed[url] = (self._timed_out("took no weight bucket") if "timed out" in report.failed[i].lower()
                               else f"the weight broadcast failed: {report.failed[i]}")
            elif call.error is not None:
                failed[url] = self._timed_out(f"did not finish {what}")
            else:
                self.last_checksums[url] = list((call.result or {}).get("checksums") or [])
        for url in failed:
            self.forget(url)
        return failed

    def _timed_out(self, what: str) -> str:
        return (f"it {what} within {self.per_server_timeout:g} s (half of weight_sync_timeout={self.timeout_s:g} s; "
                "raise weight_sync_timeout if the server is only slow)")

    def forget(self, url: str) -> None:
        """Close ``url``'s group (a dropped server; once restarted it joins a new one)."""
        group = self.groups.pop(url, None)
        if group is not None:
            group.close()

    def close(self) -> None:
        """Every server leaves its group, the groups and the staging buffers go."""
        for url in list(self.groups):
            try:
                self.request(url, "POST", LEAVE_PATH, {}, timeout=10.0, retries=0)
            except (ServerError, ServerGone) as err:
                logger.info("vLLM server %s did not leave its weight-transfer group: %s", url, _first_line(err))
            self.forget(url)
        self.sender.release()


class _Call:
    """``work()`` on a daemon thread; :meth:`wait` gives its result or its error's first line."""

    NO_ANSWER = "no answer within half of weight_sync_timeout"

    def __init__(self, work: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True, name="vllm-weight-transfer")
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self.result = work()
        except ServerGone as err:  # the request's own timeout is the server's silence, as a deadline passed is
            self.error = self.NO_ANSWER if "timed out" in err.reason.lower() else err.reason
        except Exception as err:  # reported to the caller as one line
            self.error = _first_line(err)

    def wait(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive() and self.error is None:
            self.error = self.NO_ANSWER


def _json_config(config: dict[str, Any]) -> dict[str, Any]:
    """A PEFT adapter config as JSON (sets become sorted lists), as an adapter folder's config file has it."""
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
