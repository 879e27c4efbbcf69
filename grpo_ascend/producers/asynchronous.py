"""Rollouts ahead of training (``rollout_mode: one_step_off`` and ``async``): a producer thread samples and
scores while the trainer trains, into a bounded queue.

The producer draws prompts in the same global batches as :class:`~.lockstep.LockstepSource` (every
rank the same draws, each keeping its slice), samples them through the run's
:class:`~grpo_ascend.rollout.protocol.Rollout` (a rollout process, or a vLLM server, so sampling
runs beside training), scores them on its side and queues the scored groups. The trainer takes
what each round needs (:meth:`AsyncSource.next_scored`).

Policy versions are the optimizer steps whose weights a sampler holds; the trainer pushes them
through :meth:`AsyncSource.policy_updated`. ``one_step_off``: batch ``k`` is sampled with the
weights at the end of round ``k - 2`` (pinned: exactly one round old when trained), the trainer
pushing after every round. ``async``: the producer samples with the newest weights pushed
(every ``weight_sync_steps`` steps), keeps at most ``max_inflight`` prompts ahead and
``queue_maxsize`` completions queued, and a group more than ``max_staleness`` versions older
than the step that would train it is dropped, counted, and its prompt sampled again (never lost).

Each group's draw index is its ledger entry: a checkpoint records the oldest draw not yet trained
and the trained draws past it (:meth:`AsyncSource.state_dict`), so a resumed run samples again
exactly what was in flight, and nothing twice.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.errors import RolloutError, RolloutInterrupted
from grpo_ascend.experience import Experience
from grpo_ascend.producers.lockstep import SourceParts, draw_slice
from grpo_ascend.tracking.phases import PhaseTimer

_WAIT_S = 0.2


@dataclass(frozen=True)
class AsyncSettings:
    """How far the producer runs ahead (see the module docstring); counts are per rank."""

    mode: str
    prompts_per_round: int
    steps_per_round: int
    max_inflight: int
    max_staleness: int
    queue_maxsize: int
    weight_sync_steps: int

    @property
    def steps_per_version(self) -> int:
        """Optimizer steps between two pushes: a round (one_step_off), or ``weight_sync_steps``."""
        return self.steps_per_round if self.mode == "one_step_off" else self.weight_sync_steps


@dataclass
class _Chunk:
    """One global draw's slice: this rank's rows and their global draw indices."""

    index: int
    key: int  # the global draw index of the draw's first prompt (its ledger entry)
    rows: list[dict[str, Any]]
    group_ids: Tensor


@dataclass
class _Scored:
    chunk: _Chunk
    exp: Experience
    version: int


@dataclass
class _RoundStats:
    staleness: list[float] = field(default_factory=list)
    dropped: int = 0
    aborted_tokens: float = 0.0
    producer_idle_s: float = 0.0
    producer_busy_s: float = 0.0
    trainer_wait_s: float = 0.0
    push_s: float = 0.0
    pushes: int = 0
    sampler_weight_wait_s: float | None = None  # None: the sampler reports no such wait


class AsyncSource:
    """The producer thread and the queue between it and the trainer (see the module docstring).

    ``push()`` sends the policy's current weights to the sampler (every rank calls it together, from
    :meth:`policy_updated`); ``trainer_state()`` is what reward functions receive.
    """

    def __init__(self, *, parts: SourceParts, settings: AsyncSettings, push: Callable[[int], None]) -> None:
        self.parts = parts
        self.sampler, self.rollout, self.ranks = parts.sampler, parts.rollout, parts.ranks
        self.settings = settings
        self.push = push
        self._cv = threading.Condition()
        self._queue: collections.deque[_Scored] = collections.deque()
        self._reissue: collections.deque[_Chunk] = collections.deque()
        self._inflight = 0  # prompts drawn and not yet trained (a dropped group's are sampled again)
        self._published = -1  # the newest version pushed
        self._step = 0  # the trainer's optimizer step (the version a group would be trained at)
        self._chunks = 0  # chunks drawn since start (one_step_off's round index)
        self._first_step = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._trainer_state: Callable[[], dict[str, Any]] = dict
        self._stats = _RoundStats()
        self._metrics_at = time.perf_counter()
        # the ledger: sampler state before each chunk still open, and the draws trained past the oldest
        self._open: dict[int, dict[str, Any]] = {}
        self._remaining: dict[int, int] = {}
        self._trained_past: set[int] = set()
        self._skip: set[int] = set()

    # ------------------------------------------------------------------ the trainer's side
    def start(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        """Push the current weights as version ``step`` and start the producer (at ``train()``'s start)."""
        self._trainer_state = trainer_state
        self._step = self._first_step = step
        with self._cv:  # a later train(): what the last one left in flight is sampled again, numbered anew
            self._error = None
            self._reissue = collections.deque(sorted(self._reissue, key=lambda chunk: chunk.key))
            for index, chunk in enumerate(self._reissue):
                chunk.index = index
            self._chunks = len(self._reissue)
        self.policy_updated(step, force=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._produce, daemon=True, name="grpo-ascend-producer")
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the producer thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def policy_updated(self, step: int, force: bool = False) -> None:
        """The trainer finished optimizer step ``step``: push the weights when a version is due."""
        self._step = step
        due = (step - self._first_step) % self.settings.steps_per_version == 0
        if force or due:
            began = time.perf_counter()
            self.push(step)
            self._stats.push_s += time.perf_counter() - began
            self._stats.pushes += 1
            with self._cv:
                self._published = step
                self._cv.notify_all()

    def next_scored(self, prompts_per_rank: int, timer: PhaseTimer,
                    trainer_state: Callable[[], dict[str, Any]]) -> Experience:
        """The next ``prompts_per_rank`` fresh-enough groups from the queue (waiting on the producer)."""
        parts: list[Experience] = []
        have = 0
        with timer.phase("generation"):
            started = time.perf_counter()
            while have < prompts_per_rank:
                item = self._take()
                staleness = (self._step - item.version) // self.settings.steps_per_version
                if self.settings.mode == "async" and staleness > self.settings.max_staleness:
                    self._drop(item)
                    continue
                groups = len(item.chunk.rows)
                take = min(groups, prompts_per_rank - have)
                if take < groups:
                    head, rest = _split(item, take)
                    with self._cv:
                        self._queue.appendleft(rest)
                    item = head
                parts.append(item.exp)
                have += take
                self._mark_trained(item.chunk)
                self._stats.staleness.extend([float(staleness)] * take)
            self._stats.trainer_wait_s += time.perf_counter() - started
        return parts[0] if len(parts) == 1 else Experience.concat(parts, self.rollout.backend.pad_token_id)

    def metrics(self) -> dict[str, float]:
        """This rank's numbers since the last call: staleness, dropped groups, each side's idle time."""
        stats, self._stats = self._stats, _RoundStats()
        now = time.perf_counter()
        span, self._metrics_at = now - self._metrics_at, now
        stale = stats.staleness or [0.0]
        busy = stats.producer_busy_s + stats.producer_idle_s
        weight_wait = {} if stats.sampler_weight_wait_s is None else {
            "async/sampler_weight_wait_s": stats.sampler_weight_wait_s}
        return {
            **weight_wait,
            "async/weight_push_s": stats.push_s,
            "async/weight_pushes": float(stats.pushes),
            "async/staleness_mean": sum(stale) / len(stale),
            "async/staleness_max": max(stale),
            "async/dropped_groups": float(stats.dropped),
            "async/aborted_tokens": stats.aborted_tokens,
            "async/producer_idle_fraction": stats.producer_idle_s / busy if busy else 0.0,
            "async/trainer_wait_s": stats.trainer_wait_s,
            "async/trainer_idle_fraction": min(stats.trainer_wait_s / span, 1.0) if span > 0 else 0.0,
            "async/queued_groups": float(sum(len(s.chunk.rows) for s in self._queue)),
        }

    def close(self) -> None:
        """Stop the producer; the groups it sampled and the trainer did not take (and a sample being made)
        stay in flight, to be sampled again by a later ``train()`` (a checkpoint's ledger already has them)."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        with self._cv:
            self._reissue.extend(item.chunk for item in self._queue)
            self._queue.clear()

    def state_dict(self) -> dict[str, Any]:
        """The ledger: the sampler state at the oldest draw not yet trained, and the draws trained past it."""
        with self._cv:
            oldest = min(self._open) if self._open else None
            state = self._open[oldest] if oldest is not None else self.sampler.state_dict()
            return {"sampler": state, "trained": sorted(self._trained_past)}  # kept past the oldest only

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's ledger: draw again from its oldest untrained draw, skipping trained ones."""
        self.sampler.load_state_dict(state["sampler"])
        self._skip = set(state.get("trained", []))

    # ------------------------------------------------------------------ the producer's side
    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                chunk = self._next_chunk()
                if chunk is None:
                    return
                try:
                    self._produce_one(chunk)
                except BaseException:
                    with self._cv:
                        self._reissue.appendleft(chunk)  # still in flight: sampled again after a restart
                    raise
        except RolloutInterrupted:
            if not self._stop.is_set():
                raise
        except BaseException as exc:  # handed to the trainer at its next take
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _produce_one(self, chunk: _Chunk) -> None:
        """Sample and score ``chunk`` and queue it (a stop on the way raises RolloutInterrupted)."""
        version = self._gate(chunk)
        if self._stop.is_set():
            raise RolloutInterrupted("the producer is stopping")
        began = time.perf_counter()
        batch = self._sample(chunk, version)
        if batch.policy_versions is None:  # a sampler that does not tag its tokens (a rollout_func)
            batch.policy_versions = torch.full_like(
                batch.completion_ids, version if version is not None else self._published)
        sampled = int(batch.policy_versions.min())
        self._stats.aborted_tokens += batch.timing.get("aborted_tokens", 0.0)
        if "weight_wait_s" in batch.timing:
            self._stats.sampler_weight_wait_s = (self._stats.sampler_weight_wait_s or 0.0) + batch.timing["weight_wait_s"]
        exp = self.parts.score(chunk.rows, chunk.group_ids, batch, self._trainer_state(),
                               PhaseTimer(batch.completion_ids.device))
        self._stats.producer_busy_s += time.perf_counter() - began
        with self._cv:
            self._queue.append(_Scored(chunk, exp, sampled))
            self._cv.notify_all()

    def _sample(self, chunk: _Chunk, version: int | None) -> Any:
        """``chunk``'s completions; work a recovering sampler lost (a restarted process) is sampled again."""
        while True:
            try:
                with torch.no_grad(), self.rollout.backend.pinned(version):
                    return self.rollout.generate_rows(chunk.rows, generator=self.parts.generator)
            except RolloutInterrupted:
                if self._stop.is_set():
                    raise

    def _next_chunk(self) -> _Chunk | None:
        """A dropped chunk to sample again, else the next draw once there is room (None: stopping)."""
        s, G = self.settings, self.rollout.params.num_generations
        began = time.perf_counter()
        with self._cv:
            while not self._stop.is_set():
                if self._reissue:
                    return self._reissue.popleft()
                queued = sum(len(item.chunk.rows) for item in self._queue) * G
                if self._inflight + s.prompts_per_round <= s.max_inflight and queued < s.queue_maxsize:
                    break
                self._cv.wait(_WAIT_S)
            else:
                return None
            self._stats.producer_idle_s += time.perf_counter() - began
            while True:
                state = self.sampler.state_dict()
                rows, ids = draw_slice(self.sampler, self.ranks, s.prompts_per_round)
                key = int(ids[0]) - self.ranks.rank * s.prompts_per_round
                if key not in self._skip:
                    break
                self._skip.discard(key)  # trained before the checkpoint this run resumed from
            chunk = _Chunk(self._chunks, key, rows, ids)
            self._chunks += 1
            self._open[key] = state
            self._remaining[key] = len(rows)
            self._inflight += len(rows)
            return chunk

    def _gate(self, chunk: _Chunk) -> int | None:
        """one_step_off: wait until the weights of the end of round ``index - 2`` are pushed and pin them;
        async: None (the newest pushed)."""
        if self.settings.mode != "one_step_off":
            return None
        wanted = self._first_step + max(chunk.index - 1, 0) * self.settings.steps_per_round
        began = time.perf_counter()
        with self._cv:
            while self._published < wanted and not self._stop.is_set():
                self._cv.wait(_WAIT_S)
        self._stats.producer_idle_s += time.perf_counter() - began
        return None if self._stop.is_set() else wanted

    # ------------------------------------------------------------------ the queue
    def _take(self) -> _Scored:
        with self._cv:
            while not self._queue:
                if self._error is not None:
                    raise RolloutError(f"the rollout producer stopped: {self._error}") from self._error
                if self._thread is None or not self._thread.is_alive():
                    raise RolloutError("the rollout producer is not running (call start first, or it ended)")
                self._cv.wait(_WAIT_S)
            return self._queue.popleft()

    def _drop(self, item: _Scored) -> None:
        """A group too stale to train: counted, and its prompts sampled again (first in the producer's line)."""
        with self._cv:
            self._stats.dropped += len(item.chunk.rows)
            self._reissue.append(item.chunk)
            self._cv.notify_all()

    def _mark_trained(self, chunk: _Chunk) -> None:
        """``chunk``'s rows are trained: out of flight, and into the ledger once its whole draw is."""
        with self._cv:
            self._inflight -= len(chunk.rows)
            self._remaining[chunk.key] -= len(chunk.rows)
            if self._remaining[chunk.key] == 0:
                del self._remaining[chunk.key]
                del self._open[chunk.key]
                self._trained_past.add(chunk.key)
                oldest = min(self._open) if self._open else None
                self._trained_past = {k for k in self._trained_past if oldest is not None and k > oldest}
            self._cv.notify_all()


def _split(item: _Scored, taken: int) -> tuple[_Scored, _Scored]:
    """``item``'s first ``taken`` groups, and the rest."""
    G = item.exp.size // len(item.chunk.rows)
    device = item.exp.group_ids.device
    parts = []
    for rows, index in ((slice(0, taken), torch.arange(taken * G, device=device)),
                        (slice(taken, None), torch.arange(taken * G, item.exp.size, device=device))):
        chunk = _Chunk(item.chunk.index, item.chunk.key, item.chunk.rows[rows], item.chunk.group_ids[rows])
        parts.append(_Scored(chunk, item.exp.select(index), item.version))
    return parts[0], parts[1]
