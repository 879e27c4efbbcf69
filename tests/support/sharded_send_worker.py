"""One rank of tests/weight_transfer/test_sharded_send.py: ``python sharded_send_worker.py OUT_DIR``.

Two ranks join a gloo group (the launcher's RANK / WORLD_SIZE / MASTER_* environment), shard a tiny Qwen2 model
(tied and untied head) with FSDP2 (one unit per decoder layer, the root), take one Adam step on the same batch,
then stream the weights through the FSDP strategy: rank 0 sends them over a transfer group to a receiver thread
and records what arrived and the most bytes of whole tensors alive at once; rank 1 only takes part in the gathers.
"""

from __future__ import annotations

import sys
import threading
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sharded_send_model import BUCKET_BYTES, VARIANTS, stepped_model  # noqa: E402

from grpo_ascend.distributed.fsdp import FSDPStrategy  # noqa: E402
from grpo_ascend.rollout.policy_weights import PolicyWeights  # noqa: E402
from grpo_ascend.weight_transfer.group import TransferGroup  # noqa: E402
from grpo_ascend.weight_transfer.manifest import Manifest  # noqa: E402
from grpo_ascend.weight_transfer.receiver import WeightReceiver  # noqa: E402
from grpo_ascend.weight_transfer.sender import WeightSender  # noqa: E402


class AliveWholeTensors:
    """The FSDP strategy's streaming, counting the bytes of whole tensors it handed out that are still alive."""

    def __init__(self, strategy: FSDPStrategy) -> None:
        self.strategy, self.alive, self.most = strategy, 0, 0

    def full_shape(self, tensor: torch.Tensor) -> tuple[int, ...]:
        return self.strategy.full_shape(tensor)

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes

    def stream_whole(self, named):
        for name, tensor in self.strategy.stream_whole(named):
            nbytes = tensor.numel() * tensor.element_size()
            self.alive += nbytes
            self.most = max(self.most, self.alive)
            weakref.finalize(tensor, self._freed, nbytes)
            yield name, tensor
            del tensor


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def received_over_a_group(manifest: Manifest, weights: PolicyWeights) -> dict[str, torch.Tensor]:
    store, address = TransferGroup.listen(2, 30.0)
    joined: list[TransferGroup] = []
    got: dict[str, torch.Tensor] = {}
    thread = threading.Thread(target=lambda: joined.append(TransferGroup.join(address, 1, "cpu", 30.0)))
    thread.start()
    sender_group = TransferGroup.build(store, address, 0, "cpu", 30.0)
    thread.join()

    def receive() -> None:
        for bucket in WeightReceiver(joined[0]).buckets(manifest):
            got.update((name, view.clone()) for name, view in bucket)

    thread = threading.Thread(target=receive)
    thread.start()
    report = WeightSender("cpu").send(manifest, weights.named_tensors(), [sender_group])
    thread.join()
    assert not report.failed, report.failed
    return got


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    strategy = object.__new__(FSDPStrategy)  # its streaming reads no state of the strategy
    results = {}
    for variant in VARIANTS:
        model = stepped_model(variant, before_step=shard)
        tracker = AliveWholeTensors(strategy)
        weights = PolicyWeights(model, 1, whole=tracker, sends=rank == 0)
        if weights.sends:
            manifest = Manifest.plan(weights.tensor_specs(), BUCKET_BYTES)  # no gather: rank 1 is not asked
            got = received_over_a_group(manifest, weights)
            results[variant] = {"received": got, "most_alive": tracker.most,
                                "dtensors": sum(type(p).__name__ == "DTensor" for p in model.parameters())}
        weights.complete()  # rank 1: its gathers; rank 0: already done
    if rank == 0:
        torch.save(results, out / "sent.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
