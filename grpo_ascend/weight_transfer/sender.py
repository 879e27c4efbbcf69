"""The sending end: the policy's tensors packed bucket by bucket and broadcast to every receiving group.

Two staging buffers alternate, so one bucket is packed (gathered, cast to the wire dtype, copied) while the
previous one is on the wire; at most two buckets of the model exist at once on the sender beside the
training parameters, whatever the model's size. Tensors arrive lazily (a sharded strategy gathers each one
as it is asked for), so a bucket's gathers happen only when that bucket is packed. A group whose broadcast fails
(its sampler died, or hung past the timeout) is left out of the later buckets and reported; the others finish.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_ascend.errors import RolloutError
from grpo_ascend.weight_transfer.group import TransferGroup
from grpo_ascend.weight_transfer.manifest import Bucket, Manifest

STAGING_BUFFERS = 2


def planned_staging_bytes(total_bytes: int, bucket_bytes: int) -> int:
    """What :meth:`WeightSender.staging_bytes` (and a receiver's two buffers) come to for ``total_bytes`` sent in
    buckets of ``bucket_bytes``, planned from sizes alone: an upper bound within the alignment padding of a bucket
    (a bucket rarely fills to the byte)."""
    if total_bytes <= 0:
        return 0
    buckets = -(-int(total_bytes) // int(bucket_bytes))
    return min(STAGING_BUFFERS, buckets) * min(int(bucket_bytes), int(total_bytes))


@dataclass
class SendReport:
    """What one transfer did: bytes per receiving group, seconds, and the groups that failed (with why)."""

    bytes_sent: int = 0
    seconds: float = 0.0
    buckets: int = 0
    failed: dict[int, str] = field(default_factory=dict)  # index into the groups given -> first error line

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_sent / self.seconds if self.seconds > 0 else 0.0


class WeightSender:
    """Packs tensors into buckets on ``device`` (the groups' buffers: the accelerator for HCCL / NCCL, the host
    for gloo) and broadcasts them; the staging buffers are kept between transfers (same bucket size)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor] = []

    def staging_bytes(self, manifest: Manifest) -> int:
        """Device bytes this sender holds while sending ``manifest``."""
        return min(STAGING_BUFFERS, len(manifest.buckets)) * manifest.largest_bucket

    def _buffer(self, k: int, nbytes: int) -> torch.Tensor:
        slot = k % STAGING_BUFFERS
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[slot][:nbytes]

    def release(self) -> None:
        """Free the staging buffers (the next transfer allocates them again)."""
        self._buffers.clear()

    def send(self, manifest: Manifest, tensors: Iterable[tuple[str, torch.Tensor]],
             groups: Sequence[TransferGroup]) -> SendReport:
        """Broadcast ``tensors`` (yielded in the manifest's order, full shapes) over ``groups``; see the module
        docstring. Raises RolloutError when ``tensors`` disagrees with the manifest (a bug, not a dead sampler)."""
        report = SendReport()
        started = time.perf_counter()
        stream = iter(tensors)
        in_flight: list[list[tuple[int, Any]]] = [[] for _ in range(STAGING_BUFFERS)]
        for k, bucket in enumerate(manifest.buckets):
            self._settle(in_flight[k % STAGING_BUFFERS], report)  # the buffer's previous bucket is off the wire
            buffer = self._buffer(k, bucket.nbytes)
            with torch.no_grad():
                _pack(bucket, stream, buffer)
            live = [i for i in range(len(groups)) if i not in report.failed]
            if not live:
                break
            for i in live:
                try:
                    in_flight[k % STAGING_BUFFERS].append((i, groups[i].broadcast(buffer)))
                except RuntimeError as err:
                    report.failed[i] = _first_line(err)
            report.buckets += 1
            report.bytes_sent += bucket.nbytes
        # run the tensors to their end: a lazy source closes what it opened (LoRA folded in, a gathered shard), and
        # a sharded one gathers in lockstep with the other training ranks even when every group failed
        extra = [name for name, _ in stream]
        for works in in_flight:
            self._settle(works, report)
        report.seconds = time.perf_counter() - started
        if extra and report.buckets == len(manifest.buckets):
            raise RolloutError(f"the weights hold {len(extra)} tensors more than the manifest ({extra[0]!r} first): "
                               "the manifest and the tensors disagree")
        return report

    @staticmethod
    def _settle(works: list[tuple[int, Any]], report: SendReport) -> None:
        for i, work in works:
            try:
                work.wait()
            except RuntimeError as err:
                report.failed.setdefault(i, _first_line(err))
        works.clear()


def _pack(bucket: Bucket, stream: Any, buffer: torch.Tensor) -> None:
    for spec in bucket.tensors:
        try:
            name, tensor = next(stream)
        except StopIteration:
            raise RolloutError(f"the weights ran out before {spec.name!r}: the manifest and the tensors disagree") from None
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise RolloutError(f"weight transfer expected {spec.name!r} {list(spec.shape)} next, got {name!r} "
                               f"{list(tensor.shape)}: the manifest and the tensors disagree")
        spec.view(buffer).copy_(tensor.detach())


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
