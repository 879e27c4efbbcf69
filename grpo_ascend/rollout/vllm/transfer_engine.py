"""The receiving end of a collective weight sync, inside a vLLM server's workers.

Our server entry point (serve.py) registers :class:`GroupTransferEngine` in vLLM's weight-transfer registry under
:data:`~.collective_sync.ENGINE_NAME` and starts vLLM with it, so every worker of the server (one per
tensor-parallel rank) builds one. A worker joins the trainer's transfer group (:mod:`grpo_ascend.weight_transfer`:
the trainer is rank 0, worker ``r`` is rank ``1 + r``) once, when the client asks, and then receives every sync's
buckets and hands each one to vLLM's own ``model.load_weights``, which takes the full (Hugging Face) tensors and
slices what this worker's tensor-parallel rank holds. vLLM's layer-wise reload runs around the load (the weights'
post-load processing, repacking for the CPU's kernels included), and a head tied to the embeddings is repacked
after it (vLLM's CPU build keeps a stale packed head otherwise).

:class:`TransferWorkerExtension` adds vLLM's worker the methods the routes call through ``collective_rpc``: the
checksums of the tensors the last sync received, when the client asked for them (a check that what arrived is bit
for bit what was sent), and receiving / dropping a LoRA adapter version into the worker's memory over the same
group (adapter_memory.py: vLLM's LoRA manager loads it from there, no folder).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_ascend import device as dev
from grpo_ascend.rollout.vllm.adapter_memory import AdapterMemory
from grpo_ascend.rollout.vllm.collective_sync import ENGINE_NAME
from grpo_ascend.rollout.vllm.colocated import repack_tied_head
from grpo_ascend.weight_transfer.group import GroupAddress, TransferGroup
from grpo_ascend.weight_transfer.manifest import Manifest
from grpo_ascend.weight_transfer.receiver import WeightReceiver

#: What serve.py passes as ``--worker-extension-cls``.
WORKER_EXTENSION = f"{__name__}.TransferWorkerExtension"


@dataclass
class GroupInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is (a :class:`GroupAddress` as JSON) and the trainer's timeout in seconds."""

    address: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 1800.0


@dataclass
class GroupUpdateInfo(WeightTransferUpdateInfo):
    """One sync: its manifest (as JSON) and whether to keep checksums of what arrived."""

    manifest: dict[str, Any] = field(default_factory=dict)
    checksums: bool = False


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SHA-256 of ``tensor``'s bytes (the same on the sender's tensor cast to the wire dtype and the receiver's view)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


class GroupTransferEngine(WeightTransferEngine[GroupInitInfo, GroupUpdateInfo]):
    """A worker's side of the trainer's transfer group; see the module docstring."""

    init_info_cls = GroupInitInfo
    update_info_cls = GroupUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: TransferGroup | None = None
        self.checksums: dict[str, str] = {}

    @property
    def rank(self) -> int:
        """This worker's rank in the transfer group (the trainer is 0)."""
        parallel = self.parallel_config
        return 1 + parallel.data_parallel_index * parallel.world_size + parallel.rank

    def init_transfer_engine(self, init_info: GroupInitInfo) -> None:
        """Join the group at ``init_info.address`` (leaving an older one: a client that re-joins builds a new one)."""
        self.shutdown()
        self.group = TransferGroup.join(GroupAddress.from_json(init_info.address), self.rank, self.device,
                                        init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_tied_head(self.model)

    def receive_weights(self, update_info: GroupUpdateInfo) -> None:
        """Receive the manifest's buckets and load each; a failed receive restores the layers not yet loaded (the
        layer-wise reload's fallback) before it is raised, so the worker keeps a whole model."""
        if self.group is None:
            raise RuntimeError("this vLLM worker has not joined a weight-transfer group; the client joins it first")
        manifest = Manifest.from_json(update_info.manifest)
        # a fresh buffer per bucket: the layer-wise reload keeps a layer's tensors until its last one arrives
        receiver = WeightReceiver(self.group, reuse_buffers=False)
        self.checksums = {}
        try:
            for bucket in receiver.buckets(manifest):
                if update_info.checksums:
                    self.checksums.update((name, tensor_checksum(view)) for name, view in bucket)
                self.model.load_weights(bucket)
        except BaseException:
            self.finish_weight_update()
            raise

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class TransferWorkerExtension:
    """Methods serve.py adds to vLLM's worker class (``--worker-extension-cls``)."""

    def grpo_received_checksums(self) -> dict[str, str]:
        """The checksums the last sync kept (empty unless it asked for them)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(engine, "checksums", {}) or {})

    def grpo_receive_adapter(self, name: str, manifest: dict[str, Any], config: dict[str, Any],
                             checksums: bool = False) -> dict[str, str]:
        """Receive the adapter ``name`` (PEFT ``config``) over this worker's transfer group and hold it in memory for
        vLLM's LoRA manager; its tensors' checksums when ``checksums``."""
        engine = getattr(self, "weight_transfer_engine", None)
        if getattr(engine, "group", None) is None:
            raise RuntimeError("this vLLM worker has not joined a weight-transfer group; the client joins it first")
        memory = AdapterMemory.of(self)
        tensors: dict[str, torch.Tensor] = {}
        for bucket in WeightReceiver(engine.group, reuse_buffers=False).buckets(Manifest.from_json(manifest)):
            tensors.update(bucket)
        memory.put(name, tensors, config)
        return {n: tensor_checksum(t) for n, t in tensors.items()} if checksums else {}

    def grpo_echo_bucket(self, nbytes: int) -> None:
        """Receive one bucket of ``nbytes`` over the group and send it back (the first worker does; every rank takes
        part in both broadcasts): ``grpo-ascend smoke --vllm-server``'s round trip."""
        engine = getattr(self, "weight_transfer_engine", None)
        if getattr(engine, "group", None) is None:
            raise RuntimeError("this vLLM worker has not joined a weight-transfer group; the client joins it first")
        bucket = torch.empty(int(nbytes), dtype=torch.uint8, device=engine.group.device)
        engine.group.broadcast(bucket).wait()
        dev.broadcast(engine.group.group, bucket, 1).wait()
        dev.synchronize(engine.group.device)

    def grpo_forget_adapter(self, name: str) -> None:
        """Drop the adapter ``name`` from memory (the client unloaded it)."""
        AdapterMemory.of(self).forget(name)


def register_transfer_engine() -> None:
    """Put :class:`GroupTransferEngine` into vLLM's registry (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, GroupTransferEngine)
    except ValueError:  # registered already (this module imported twice under other names)
        pass
