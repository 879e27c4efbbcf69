"""Wall time and peak memory per phase of a round (generation, reward, reference, training, ...)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from grpo_ascend import device as dev


class PhaseTimer:
    """Accumulates seconds and the peak memory (GiB) seen in each named phase.

    The device is synchronised at the end of every phase, so asynchronous kernels are charged to
    the phase that launched them. Peak tracking restarts at each phase (on the CPU: the process's
    peak resident set, which a phase can only raise above what it started with).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        self.peak_gb: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        dev.reset_peak_memory(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            dev.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            peak = dev.memory_stats(self.device)["peak"] / 2**30
            self.peak_gb[name] = max(self.peak_gb.get(name, 0.0), peak)

    def metrics(self) -> dict[str, float]:
        """``time/<phase>`` and ``memory/peak_gb/<phase>`` for metrics.jsonl."""
        return {**{f"time/{k}": v for k, v in self.seconds.items()},
                **{f"memory/peak_gb/{k}": v for k, v in self.peak_gb.items()}}

    def clear(self) -> None:
        self.seconds.clear()
        self.peak_gb.clear()
