"""Which policy versions the vLLM servers hold, and which requests still use them.

A request takes a :meth:`VersionLedger.lease` on a version (a pinned one, or the newest) for as
long as it runs. A LoRA adapter version stays loaded while it is among the ``keep`` newest or a
request holds it; the versions that are neither are handed back, once, for unloading (by whoever
made them so: the sync that superseded them, or the request that let the last one go). Full weights
are replaced in place: a new version supersedes the old at once, and a request pinned to an older
version samples with the newest (nothing older exists on the server).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.errors import RolloutError


@dataclass(frozen=True)
class Loaded:
    """One version on the servers: the model name requests use, and for an adapter either its folder or, sent over
    transfer groups, ``sent`` (its PEFT config and a host copy of its tensors, sent again to a restarted server).
    Neither: full weights."""

    version: int
    name: str
    folder: Path | None = None
    sent: tuple[dict[str, Any], list[tuple[str, torch.Tensor]]] | None = field(default=None, compare=False, repr=False)

    @property
    def adapter(self) -> bool:
        return self.folder is not None or self.sent is not None


class VersionLedger:
    """The versions loaded (oldest first) and the leases on them; thread-safe."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = max(1, int(keep))
        self._loaded: collections.OrderedDict[int, Loaded] = collections.OrderedDict()
        self._leases: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()

    @property
    def newest(self) -> Loaded | None:
        with self._lock:
            return next(reversed(self._loaded.values()), None)

    @property
    def held(self) -> list[Loaded]:
        """The versions loaded, oldest first."""
        with self._lock:
            return list(self._loaded.values())

    @property
    def versions(self) -> list[int]:
        """The version numbers loaded, oldest first."""
        return [v.version for v in self.held]

    def leased(self, version: int) -> int:
        """Requests holding ``version`` now."""
        with self._lock:
            return self._leases[version]

    def add(self, loaded: Loaded) -> list[Loaded]:
        """``loaded`` is on every server; the versions to unload now (full weights: none, they were overwritten)."""
        with self._lock:
            if not loaded.adapter:
                self._loaded.clear()
            self._loaded[loaded.version] = loaded
            return self._retire()

    def lease(self, version: int | None) -> Loaded | None:
        """Hold ``version`` (None: the newest) for one request; None before the first sync (the base model)."""
        with self._lock:
            if not self._loaded:
                return None
            newest = next(reversed(self._loaded.values()))
            if version is None or not newest.adapter:
                chosen = newest
            elif version in self._loaded:
                chosen = self._loaded[version]
            else:
                raise RolloutError(f"policy version {version} is not on the vLLM servers (they hold "
                                   f"{list(self._loaded)}); a request can pin one of the newest {self.keep} versions")
            self._leases[chosen.version] += 1
            return chosen

    def clear(self) -> list[Loaded]:
        """Forget every version (the client closes); the adapter versions, to unload."""
        with self._lock:
            gone = [v for v in self._loaded.values() if v.adapter]
            self._loaded.clear()
            return gone

    def release(self, loaded: Loaded | None) -> list[Loaded]:
        """A request holding ``loaded`` ended; the versions to unload now."""
        if loaded is None:
            return []
        with self._lock:
            self._leases[loaded.version] -= 1
            if self._leases[loaded.version] <= 0:
                del self._leases[loaded.version]
            return self._retire()

    def _retire(self) -> list[Loaded]:
        """Adapter versions past the ``keep`` newest that no request holds, taken out of the ledger."""
        old = list(self._loaded.values())[:-self.keep]
        gone = [v for v in old if v.adapter and self._leases[v.version] == 0]
        for v in gone:
            del self._loaded[v.version]
        return gone
