"""One transfer group: the trainer's sending rank (rank 0) and a sampler's receiving ranks, on a store of their own.

The sender hosts a ``TCPStore`` (:meth:`TransferGroup.listen`), tells the receivers its :class:`GroupAddress`,
and every rank builds the group (HCCL / NCCL / gloo, chosen by the device layer) over that store; building
waits until all ``world_size`` ranks joined, at most ``timeout_s`` seconds. Nothing here touches
``torch.distributed``'s default group, so training ranks and a sampler's own ranks are left alone.
"""

from __future__ import annotations

import datetime
import socket
import threading
import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from grpo_ascend import device as dev
from grpo_ascend.errors import RolloutError


@dataclass(frozen=True)
class GroupAddress:
    """Where receivers find a group's store, and how many ranks it has (rank 0 sends)."""

    host: str
    port: int
    world_size: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupAddress:
        return cls(str(data["host"]), int(data["port"]), int(data["world_size"]))


def address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host (what a sampler there can reach us at)."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # a UDP "connect" sends nothing; it only picks the route
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def receiver_timeout(timeout_s: float) -> float:
    """How long a receiver waits for one bucket when the sender gives up on a rank after ``timeout_s``."""
    return 2.0 * float(timeout_s) + 10.0


class TransferGroup:
    """A built group (see the module docstring); ``rank`` 0 sends, the others receive."""

    #: Groups built in this process so far (a run builds one per sampler, not one per sync).
    built = 0
    _count_lock = threading.Lock()

    def __init__(self, group: Any, store: Any, rank: int, address: GroupAddress, device: torch.device) -> None:
        self.group, self.store, self.rank, self.address, self.device = group, store, rank, address, device
        with TransferGroup._count_lock:
            TransferGroup.built += 1

    @staticmethod
    def listen(world_size: int, timeout_s: float, advertise: str = "127.0.0.1", port: int = 0) -> tuple[Any, GroupAddress]:
        """Host the store of a new group of ``world_size`` ranks; returns it and the address receivers join at."""
        store = dist.TCPStore("0.0.0.0", port, None, True, datetime.timedelta(seconds=float(timeout_s)),
                              wait_for_workers=False)
        return store, GroupAddress(advertise, int(store.port), int(world_size))

    @classmethod
    def build(cls, store: Any, address: GroupAddress, rank: int, device: torch.device | str,
              timeout_s: float) -> TransferGroup:
        """This rank's side of the group at ``address`` over ``store`` (the sender's own, or a client of it)."""
        device = torch.device(device)
        try:
            group = dev.stateless_group(store, rank, address.world_size, device, timeout_s)
        except RuntimeError as err:
            raise RolloutError(f"the weight-transfer group at {address.host}:{address.port} ({address.world_size} "
                               f"ranks, {dev.transfer_backend(device)}) could not be built within {timeout_s:g} s: "
                               f"{str(err).splitlines()[0]}") from None
        return cls(group, store, rank, address, device)

    @classmethod
    def join(cls, address: GroupAddress, rank: int, device: torch.device | str, timeout_s: float) -> TransferGroup:
        """A receiver's side: connect to the sender's store at ``address`` and build the group as ``rank``.

        ``timeout_s`` is the sender's; a receiver waits :func:`receiver_timeout` of it per bucket, so a sender held up
        by another sampler that hung (for at most one timeout, then that one is dropped) never makes a healthy
        receiver give up."""
        wait = receiver_timeout(timeout_s)
        store = dist.TCPStore(address.host, address.port, None, False, datetime.timedelta(seconds=wait))
        return cls.build(store, address, rank, device, wait)

    @property
    def backend(self) -> str:
        return dev.transfer_backend(self.device)

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting ``tensor`` from rank 0; the work handle (``.wait()`` raises if a rank failed)."""
        return dev.broadcast(self.group, tensor, 0)

    def close(self) -> None:
        """Drop the group and its store (a later run, or a restarted sampler, builds a new one)."""
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:
                pass
        self.group = None
        self.store = None
