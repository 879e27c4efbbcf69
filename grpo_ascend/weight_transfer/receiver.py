"""The receiving end: each bucket received into a flat buffer and handed out as views, one bucket at a time.

The receive of bucket k+1 is posted before bucket k is handed out, so loading one bucket overlaps the wire
time of the next; the views of a bucket are valid until the caller asks for the next one (a loader copies
them into its parameters). A loader that keeps views longer (vLLM's layer-wise reload holds a layer's tensors
until the layer's last one arrived, which may be in a later bucket) asks for a fresh buffer per bucket
(``reuse_buffers=False``): a bucket's memory then lives as long as a view of it does.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from grpo_ascend.errors import RolloutError
from grpo_ascend.weight_transfer.group import TransferGroup
from grpo_ascend.weight_transfer.manifest import Manifest
from grpo_ascend.weight_transfer.sender import STAGING_BUFFERS


class WeightReceiver:
    """Receives manifests' buckets over ``group`` (rank > 0) into buffers kept between transfers."""

    def __init__(self, group: TransferGroup, reuse_buffers: bool = True) -> None:
        self.group = group
        self.reuse_buffers = reuse_buffers
        self._buffers: list[torch.Tensor] = []

    def _buffer(self, k: int, nbytes: int) -> torch.Tensor:
        if not self.reuse_buffers:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        slot = k % STAGING_BUFFERS
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.group.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        return self._buffers[slot][:nbytes]

    def buckets(self, manifest: Manifest) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket of ``manifest`` as ``(name, view)`` pairs, in order (see the module docstring)."""
        pending = []
        for k in range(min(STAGING_BUFFERS, len(manifest.buckets))):
            pending.append(self._post(manifest, k))
        for k, bucket in enumerate(manifest.buckets):
            buffer, work = pending[k]
            try:
                work.wait()
            except RuntimeError as err:
                raise RolloutError(f"receiving weight bucket {k + 1} of {len(manifest.buckets)} failed: "
                                   f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
            yield [(spec.name, spec.view(buffer)) for spec in bucket.tensors]
            if k + STAGING_BUFFERS < len(manifest.buckets):
                pending.append(self._post(manifest, k + STAGING_BUFFERS))

    def _post(self, manifest: Manifest, k: int) -> tuple[torch.Tensor, object]:
        buffer = self._buffer(k, manifest.buckets[k].nbytes)
        return buffer, self.group.broadcast(buffer)

    def release(self) -> None:
        self._buffers.clear()
