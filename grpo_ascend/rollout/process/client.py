"""The trainer's side of a rollout process: a :class:`RolloutBackend` whose sampling runs elsewhere.

:class:`ProcessBackend` starts the built-in engine in a fresh process (:mod:`.worker`) over a
stand-alone copy of the policy handed over in shared memory, and pushes later policy versions
through a :class:`~grpo_ascend.rollout.process.weight_ring.WeightRing`, or, on an accelerator of its own, over a
transfer group (``receive_weights``; the group built at the first push after the process started, reused). Every request waits with
three limits: the process is alive (a dead one is restarted, up to ``max_restarts`` times, and a
grouped-completions request is sent again), its heartbeat is fresher than
``heartbeat_stale_after_s``, and the request finishes within ``request_timeout``; past them the run
stops with one :class:`~grpo_ascend.errors.RolloutError` line instead of hanging.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpo_ascend.errors import RolloutError, RolloutInterrupted
from grpo_ascend.models.sampler_copy import sampler_copy, synced_tensors
from grpo_ascend.rollout.backend import (
    RolloutBackend,
    RolloutBatch,
    RolloutSession,
    SessionOutput,
    TurnEnd,
)
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.process.weight_ring import WeightRing, spawn_context
from grpo_ascend.rollout.process.worker import WorkerSpec, serve, to_device
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.vision.inputs import PromptImages, RowVision
from grpo_ascend.weight_transfer.group import TransferGroup
from grpo_ascend.weight_transfer.manifest import Manifest, TensorSpec
from grpo_ascend.weight_transfer.sender import SendReport, WeightSender
from grpo_ascend.weight_transfer.settings import default_bucket_bytes

logger = logging.getLogger(__name__)
_POLL_S = 0.2
#: Seconds a push that failed waits for the rollout process to be reaped before taking it for hung, not dead.
EXIT_GRACE_S = 1.0


@dataclass(frozen=True)
class ProcessSettings:
    """Where the rollout process runs and how long the trainer waits for it (docs/async.md)."""

    device: str = "cpu"
    threads: int | None = None
    precision: str = "fp32"
    max_restarts: int = 3
    heartbeat_stale_after_s: float = 300.0
    request_timeout: float = 600.0
    weight_sync_timeout: float = 1800.0
    partial_rollouts: str = "continue"
    #: "ring" (host shared memory) or "collective" (a transfer group; weight_transfer/settings.py decides).
    transfer: str = "ring"
    bucket_bytes: int | None = None


class ProcessRestarted(RolloutInterrupted):
    """The rollout process died during a session and was restarted: the session's rows must be sampled again."""


class ProcessBackend(RolloutBackend):
    """The built-in engine in a rollout process of its own (see the module docstring).

    Sampling calls name a policy version through :meth:`pinned` (per calling thread; default the
    newest pushed; a request pinned to one samples all its tokens with it); :attr:`last_version` is the version the calling thread's last request sampled with.
    """

    takes_images = True
    streams_weights = False  # a sync reads the policy module whole (LoRA merged into its weights)

    def __init__(self, policy: nn.Module, tokenizer: Any, params: SamplingParams, settings: ProcessSettings,
                 device: torch.device, version: int) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.settings = settings
        self._device = device
        self._copy = sampler_copy(policy)
        self._context = spawn_context(type(self._copy).__module__, type(tokenizer).__module__)
        self.ring: WeightRing | None = None
        self._group: TransferGroup | None = None
        self._published = version
        if settings.transfer == "collective":
            specs = [(name, t.dtype, tuple(t.shape)) for name, t in synced_tensors(policy)]
            largest = max((TensorSpec(*spec).nbytes for spec in specs), default=0)
            bucket = settings.bucket_bytes or default_bucket_bytes(device, largest)
            self._manifest = Manifest.plan(specs, bucket)
            self._sender = WeightSender(device)
        else:
            self.ring = WeightRing(dict(synced_tensors(policy)), self._context)
        self._initial_version = version
        self._lock = threading.RLock()
        self._local = threading.local()
        self._sessions = itertools.count()
        self.restarts = 0
        self._process: Any = None
        self._start()
        self._pad, self._eos = self._call("hello")

    # ------------------------------------------------------------------ the process
    def _start(self) -> None:
        if self.ring is None:  # a new process holds the weights it is started with until the next push
            self._published = self._initial_version
        self._conn, child = self._context.Pipe()
        self._heartbeat = self._context.Value("d", 0.0)  # 0 until the process beats (its start-up: request_timeout)
        spec = WorkerSpec(self._copy, self.tokenizer, self.params, self.settings.device, self.settings.threads,
                          self.settings.precision, self._initial_version, self.settings.weight_sync_timeout,
                          self.settings.partial_rollouts, self.settings.transfer)
        self._process = self._context.Process(target=serve, args=(child, spec, self.ring, self._heartbeat),
                                              daemon=True, name="grpo-ascend-rollout")
        with _main_script_hidden():
            self._process.start()
        child.close()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _call(self, op: str, *args: Any, retry: bool = True) -> Any:
        """One request, answered or failed within the limits (see the module docstring)."""
        with self._lock:
            if self._process is None:  # closed at the end of a train(): a later evaluate() or train() starts it again
                self._start()
            while True:
                try:
                    return self._exchange(op, args)
                except _Died as died:
                    self._restart(str(died))
                    if not retry:
                        raise ProcessRestarted(f"the rollout process died during a session ({died}); it was restarted "
                                               "and the session's rows are sampled again") from None

    def _exchange(self, op: str, args: tuple[Any, ...], during: Callable[[], None] | None = None,
                  limit: tuple[str, float] | None = None) -> Any:
        """``op`` answered; ``during``: what this side does while the process works on it (a weight push's
        buckets); ``limit``: the setting and seconds it may take (default request_timeout)."""
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, OSError) as exc:
            raise _Died(f"pipe closed: {exc}") from None
        if during is not None:
            during()
        setting, seconds = limit or ("request_timeout", self.settings.request_timeout)
        started = time.monotonic()
        while not self._conn.poll(_POLL_S):
            if not self._process.is_alive():
                raise _Died(f"exit code {self._process.exitcode}")
            quiet = time.time() - self._heartbeat.value
            if self._heartbeat.value > 0 and quiet > self.settings.heartbeat_stale_after_s:
                self._stop_process()
                raise RolloutError(f"the rollout process's heartbeat stopped {quiet:.0f} s ago "
                                   f"(heartbeat_stale_after_s={self.settings.heartbeat_stale_after_s:g}); ending the run "
                                   "instead of waiting on it")
            if time.monotonic() - started > seconds:
                self._stop_process()
                raise RolloutError(f"rollout request {op!r} took more than {setting}={seconds:g} s; raise {setting} "
                                   "if it is legitimately that slow")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise _Died(f"pipe closed: {exc}") from None
        if status == "interrupted":
            raise RolloutInterrupted(value)
        if status == "error":
            raise RolloutError(f"the rollout process failed on {op!r}: {value}")
        return value

    def _restart(self, why: str) -> None:
        if self.restarts >= self.settings.max_restarts:
            raise RolloutError(f"the rollout process died ({why}) after {self.restarts} restarts "
                               f"(max_rollout_restarts={self.settings.max_restarts}); see its output above")
        self.restarts += 1
        logger.warning("the rollout process died (%s); restarting it (%d of %d)", why, self.restarts,
                       self.settings.max_restarts)
        if self.ring is None:
            logger.warning("the restarted rollout process samples with the run's first weights (version %d, tagged "
                           "so) until the next weight push", self._initial_version)
        self._stop_process()
        self._start()

    def _stop_process(self) -> None:
        if self._group is not None:  # the next process joins a new group
            self._group.close()
            self._group = None
        if self._process is not None:
            if self._process.is_alive():
                self._process.kill()
            self._process.join(timeout=10)
        self._process = None
        self._conn.close()

    def close(self) -> None:
        """Stop the rollout process; the next request starts a fresh one (the newest weights pushed)."""
        if self._process is None:
            return
        with self._lock:
            if self._process.is_alive():
                try:
                    self._conn.send(("stop", ()))
                    if self._conn.poll(5):
                        self._conn.recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass
            self._process.join(timeout=5)
            self._stop_process()

    # ------------------------------------------------------------------ versions
    @property
    def last_version(self) -> int:
        """The version this thread's last sampling request used."""
        return getattr(self._local, "used", self._initial_version)

    @property
    def published_version(self) -> int:
        """The newest version pushed (-1 before the first through the ring; the start's over a group)."""
        return int(self.ring.latest.value) if self.ring is not None else self._published

    # ------------------------------------------------------------------ RolloutBackend
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def pad_token_id(self) -> int:
        return self._pad

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None,
                     generator: torch.Generator | None = None,
                     prompt_texts: Sequence[str] | None = None) -> RolloutBatch:
        return self._generate(prompt_ids, None, params, generator, prompt_texts)

    def generate_with_images(self, prompt_ids: Sequence[Sequence[int]], images: Sequence[PromptImages],
                             params: SamplingParams | None = None, generator: torch.Generator | None = None,
                             prompt_texts: Sequence[str] | None = None) -> RolloutBatch:
        """Prompts with images: their image inputs travel with the request (CPU tensors)."""
        return self._generate(prompt_ids, list(images), params, generator, prompt_texts)

    def _generate(self, prompt_ids: Sequence[Sequence[int]], images: list[PromptImages] | None,
                  params: SamplingParams | None, generator: torch.Generator | None,
                  prompt_texts: Sequence[str] | None) -> RolloutBatch:
        params = self.checked(params)
        batch = self._call("generate", [list(p) for p in prompt_ids], params, _seed(generator),
                           None if prompt_texts is None else list(prompt_texts), self.pinned_version, images)
        self._local.used = int(batch.policy_versions.flatten()[0]) if batch.policy_versions.numel() else self.pinned_version
        if images is not None:
            batch.vision = RowVision.repeated(images, params.num_generations)
        return to_device(batch, self._device)

    def start_session(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None,
                      generator: torch.Generator | None = None) -> RolloutSession:
        params = self.checked(params)
        sid = next(self._sessions)
        self._local.used = self._call("start_session", sid, [list(p) for p in prompt_ids], params, _seed(generator),
                                      self.pinned_version)
        return _ProcessSession(self, sid)

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Push ``weights`` as a new version (skipped when that version was the last pushed)."""
        if weights.version == self.published_version:
            return
        if self.ring is not None:
            self.ring.write(weights.version, synced_tensors(weights.model), self.settings.weight_sync_timeout)
            return
        with self._lock:  # after the request in flight: each request samples with one version, loaded whole
            if self._process is None:
                self._start()
            try:
                self._push(weights)
            except _Died as died:  # a restarted process starts from the run's first weights: push this one again
                self._restart(str(died))
                self._push(weights)
        self._published = weights.version

    def _push(self, weights: PolicyWeights) -> None:
        """``weights`` over the transfer group (built on the first push after the process started), one line
        within weight_sync_timeout when the process hangs, _Died when it died."""
        timeout = self.settings.weight_sync_timeout
        address = store = None
        if self._group is None:
            store, address = TransferGroup.listen(2, timeout)

        def send() -> None:
            try:
                if self._group is None:
                    self._group = TransferGroup.build(store, address, 0, self._device, timeout)
                report = self._sender.send(self._manifest, synced_tensors(weights.model), [self._group])
            except RolloutError as err:
                report = SendReport(failed={0: str(err)})
            if report.failed:
                self._process.join(EXIT_GRACE_S)  # a killed process breaks the group before it is reaped
                if not self._process.is_alive():
                    raise _Died(f"exit code {self._process.exitcode}")
                self._stop_process()
                raise RolloutError(f"the weight push of version {weights.version} to the rollout process failed "
                                   f"within weight_sync_timeout={timeout:g} s ({report.failed[0]}); it was stopped")

        self._exchange("receive_weights", (None if address is None else address.to_json(), weights.version,
                                           self._manifest.to_json()), during=send,
                       limit=("weight_sync_timeout", timeout))

    def release_memory(self) -> None:
        return None

    def restore_memory(self) -> None:
        return None


class _ProcessSession(RolloutSession):
    """A :class:`RolloutSession` living in the rollout process; a restart in between raises ProcessRestarted."""

    def __init__(self, backend: ProcessBackend, sid: int) -> None:
        self.backend = backend
        self.sid = sid
        self.restarts = backend.restarts

    def _call(self, op: str, *args: Any) -> Any:
        if self.backend.restarts != self.restarts:
            raise ProcessRestarted("the rollout process was restarted; the session's rows are sampled again")
        return self.backend._call(op, self.sid, *args, retry=False)

    def advance(self) -> list[TurnEnd]:
        return self._call("advance")

    def append(self, row: int, token_ids: Sequence[int]) -> None:
        self._call("append", row, list(token_ids))

    def output(self) -> SessionOutput:
        return to_device(self._call("output"), self.backend.device)

    def close(self) -> None:
        if self.backend.restarts == self.restarts and self.backend.pid is not None:
            self.backend._call("close_session", self.sid, retry=False)


@contextlib.contextmanager
def _main_script_hidden() -> Iterator[None]:
    """Start the process without running the caller's script again: a spawned interpreter re-imports
    ``__main__`` from its file, which re-runs a training script that has no ``if __name__ == "__main__"``
    guard. The rollout process needs nothing from it (the model and tokenizer travel pickled)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is not None and getattr(main, "__spec__", None) is None:
        del main.__file__
        try:
            yield
        finally:
            main.__file__ = path
    else:
        yield


class _Died(Exception):
    """The rollout process is gone (restartable)."""


def _seed(generator: torch.Generator | None) -> int | None:
    """A seed for the rollout process's generator, drawn from the caller's (so the caller's stream advances)."""
    if generator is None:
        return None
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
