"""The rollout process's side: the built-in engine on its own copy of the policy, serving requests.

Started by :class:`~grpo_ascend.rollout.process.client.ProcessBackend` in a fresh interpreter.
Requests arrive over a pipe, one at a time: grouped completions, and multi-turn sessions
(start, advance, append, output, close) so that tool loops, environments and a ``rollout_func``
keep running on the producer's side. Before each sampling request the process loads the
requested policy version from the shared-memory :class:`~grpo_ascend.rollout.process.weight_ring.WeightRing`
(None: the newest), or, on a device of its own, from the versions pushed over a transfer group into its
model (:class:`~grpo_ascend.rollout.process.device_versions.DeviceVersions`, the ``receive_weights`` request),
and every sampled token is tagged with the version that sampled it. A daemon thread stamps a heartbeat twice a second.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend import device as dev
from grpo_ascend.errors import RolloutInterrupted
from grpo_ascend.models.compat_transformers import register_unpickled
from grpo_ascend.rollout.backend import RolloutBatch, RolloutSession, SessionOutput
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.process.device_versions import DeviceVersions
from grpo_ascend.rollout.process.weight_ring import VersionEvicted, WeightRing, named_tensors
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.vision.inputs import PromptImages
from grpo_ascend.weight_transfer.manifest import Manifest

HEARTBEAT_PERIOD_S = 0.5


@dataclass
class WorkerSpec:
    """What a rollout process is started with (pickled into it; the model's tensors as shared memory)."""

    model: nn.Module
    tokenizer: Any
    params: SamplingParams
    device: str
    threads: int | None
    precision: str
    initial_version: int
    weight_read_timeout: float
    #: A newer version pushed while a single-turn request samples: "continue" swaps it in between two decode
    #: steps (later tokens tagged with it), "abort" starts the request again once with it (tokens thrown away).
    partial_rollouts: str = "continue"
    #: How versions arrive: "ring" (host shared memory) or "collective" (a transfer group, docs/async.md).
    transfer: str = "ring"


def to_device(record: Any, device: torch.device | str) -> Any:
    """A batch or session output with every tensor field moved to ``device``."""
    moved = {f.name: getattr(record, f.name).to(device) for f in dataclasses.fields(record)
             if isinstance(getattr(record, f.name), Tensor)}
    return dataclasses.replace(record, **moved)


class RolloutServer:
    """The engine, its weights' version, and the open sessions of one rollout process."""

    def __init__(self, spec: WorkerSpec, ring: WeightRing | None) -> None:
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.device = torch.device(spec.device)
        self.spec = spec
        self.ring: WeightRing | DeviceVersions = ring if ring is not None else DeviceVersions(spec.initial_version,
                                                                                                self.device)
        register_unpickled(spec.model)
        self.model = spec.model.to(self.device)
        self.engine = RolloutEngine(self.model, spec.tokenizer, spec.params)
        self.targets = named_tensors(self.model, self.ring.names)
        self.version = spec.initial_version
        self.sessions: dict[int, RolloutSession] = {}
        self.session_versions: dict[int, int] = {}  # the version each open session started with
        self.swaps: list[tuple[int, int]] = []  # the running request's (first column sampled with it, version)
        self.may_abort = False
        self.ops: dict[str, Callable[..., Any]] = {
            "hello": self.hello, "generate": self.generate, "start_session": self.start_session,
            "advance": self.advance, "append": self.append, "output": self.output, "close_session": self.close_session,
            "receive_weights": self.receive_weights,
        }

    def _load(self, version: int | None) -> int:
        wanted = self.ring.latest.value if version is None else version
        if wanted >= 0 and wanted != self.version:
            self.version = self.ring.read_into(self.targets, wanted, self.spec.weight_read_timeout)
        return self.version

    def receive_weights(self, address: dict[str, Any] | None, version: int, manifest: dict[str, Any]) -> int:
        """A version pushed over the transfer group (``address``: the group to join first, on the first push after
        the process started), received whole before the next request samples (requests come one at a time)."""
        if not isinstance(self.ring, DeviceVersions):
            raise RuntimeError("this rollout process takes its versions from the shared-memory ring")
        if address is not None:
            self.ring.connect(address, self.spec.weight_read_timeout)
        plan = Manifest.from_json(manifest)
        self.targets = named_tensors(self.model, [t.name for t in plan.tensors])
        self.version = self.ring.receive(self.targets, version, plan)
        return self.version

    def _generator(self, seed: int | None) -> torch.Generator | None:
        return None if seed is None else torch.Generator(device=self.device).manual_seed(seed)

    def hello(self) -> tuple[int, list[int]]:
        return self.engine.pad_token_id, list(self.engine.eos_token_ids)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int | None,
                 prompt_texts: list[str] | None, version: int | None,
                 images: list[PromptImages] | None = None) -> RolloutBatch:
        """Grouped completions (``images``: each prompt's image inputs); unpinned (``version`` None), a version
        pushed meanwhile is taken per ``partial_rollouts``. ``timing["aborted_tokens"]``: token slots sampled
        and thrown away."""
        used = self._load(version)
        self.swaps = []
        self.may_abort = self.spec.partial_rollouts == "abort"
        self.engine.between_steps = self.take_newer_weights if version is None else None
        aborted = 0
        try:
            while True:
                try:
                    with torch.no_grad(), dev.autocast(self.device, self.spec.precision):
                        if images is None:
                            batch = self.engine.generate_ids(prompt_ids, params, self._generator(seed), prompt_texts)
                        else:
                            batch = self.engine.generate_with_images(prompt_ids, images, params, self._generator(seed),
                                                                     prompt_texts)
                    break
                except _Superseded as superseded:
                    aborted += superseded.steps * len(prompt_ids) * params.num_generations
                    used = self._load(None)
        finally:
            self.engine.between_steps = None
        batch = to_device(dataclasses.replace(batch, vision=None), "cpu")  # the client holds the images already
        versions = torch.full_like(batch.completion_ids, used)
        for column, newer in self.swaps:
            versions[:, column:] = newer
        batch.policy_versions = versions
        batch.timing["aborted_tokens"] = float(aborted)
        return batch

    def take_newer_weights(self, sampled: int) -> None:
        """Between two decode steps (``sampled`` tokens so far): a version pushed since the request began is
        swapped in (``continue``) or restarts the request once (``abort``)."""
        latest = self.ring.latest.value
        if latest <= self.version:
            return
        if self.may_abort:
            self.may_abort = False  # once per request: a request is never starved by frequent pushes
            raise _Superseded(sampled)
        self.swaps.append((sampled, self._load(latest)))

    def start_session(self, sid: int, prompt_ids: list[list[int]], params: SamplingParams, seed: int | None,
                      version: int | None) -> int:
        used = self._load(version)
        self.sessions[sid] = self.engine.start_session(prompt_ids, params, self._generator(seed))
        self.session_versions[sid] = used
        return used

    def advance(self, sid: int) -> list[Any]:
        """The session's next turn, on the weights it started with (another caller's request may have loaded
        others since); when the ring no longer holds them, the session is over and its rows are sampled again."""
        try:
            self._load(self.session_versions[sid])
        except VersionEvicted as exc:
            self.close_session(sid)
            raise SessionSuperseded(f"the session's weights are gone ({exc}); its rows are sampled again") from None
        with torch.no_grad(), dev.autocast(self.device, self.spec.precision):
            return self.sessions[sid].advance()

    def append(self, sid: int, row: int, token_ids: list[int]) -> None:
        self.sessions[sid].append(row, token_ids)

    def output(self, sid: int) -> SessionOutput:
        """The session's output, every token tagged with the version the session sampled with."""
        out = to_device(self.sessions[sid].output(), "cpu")
        out.policy_versions = torch.full_like(out.completion_ids, self.session_versions[sid])
        return out

    def close_session(self, sid: int) -> None:
        session = self.sessions.pop(sid, None)
        self.session_versions.pop(sid, None)
        if session is not None:
            session.close()


class SessionSuperseded(RolloutInterrupted):
    """An open session's policy version left the ring: the caller samples its rows again."""


class _Superseded(Exception):
    """A newer version arrived mid-request under ``partial_rollouts: abort``."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.steps = steps


def serve(conn: Any, spec: WorkerSpec, ring: WeightRing | None, heartbeat: Any) -> None:
    """The rollout process's main: answer requests until the pipe closes or ``stop`` arrives."""
    def beat() -> None:
        while True:
            heartbeat.value = time.time()
            time.sleep(HEARTBEAT_PERIOD_S)

    heartbeat.value = time.time()
    threading.Thread(target=beat, daemon=True, name="rollout-heartbeat").start()
    server = RolloutServer(spec, ring)
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return
        if op == "stop":
            if isinstance(server.ring, DeviceVersions):
                server.ring.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", server.ops[op](*args)))
        except RolloutInterrupted as exc:  # work lost, the process fine: the client samples it again
            conn.send(("interrupted", str(exc)))
        except Exception as exc:  # the client raises it, with the process's traceback
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
