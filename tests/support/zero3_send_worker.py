"""One rank of tests/weight_transfer/test_sharded_send.py's ZeRO-3 case: ``python zero3_send_worker.py OUT_DIR``.

Two ranks under accelerate's DeepSpeed ZeRO-3 (every parameter partitioned; the launcher's environment) take one
step of the tiny model, then stream the weights through the DeepSpeed strategy (each rank in lockstep) and, for
reference, gather the whole model at once; rank 0 saves both and the most bytes of whole tensors alive at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sharded_send_model import stepped_model  # noqa: E402
from sharded_send_worker import AliveWholeTensors  # noqa: E402

from grpo_ascend.distributed import compat_deepspeed  # noqa: E402
from grpo_ascend.distributed.deepspeed import DeepSpeedStrategy  # noqa: E402
from grpo_ascend.rollout.policy_weights import PolicyWeights  # noqa: E402


def main(out: Path) -> None:
    from accelerate import Accelerator

    compat_deepspeed.skip_shared_memory_allreduce_build()
    accelerator = Accelerator()
    model = stepped_model("untied", steps=0)
    engine, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    tracker = AliveWholeTensors(object.__new__(DeepSpeedStrategy))  # its streaming reads no state of the strategy
    weights = PolicyWeights(model, 1, whole=tracker, sends=accelerator.is_main_process)
    specs = weights.tensor_specs()  # the whole shapes, nothing gathered
    streamed = {name: t.clone() for name, t in weights.named_tensors()} if weights.sends else {}
    weights.complete()
    with compat_deepspeed.gathered(list(model.parameters())):
        whole = {name: t.detach().clone() for name, t in model.state_dict().items()}
    partitioned = sum(compat_deepspeed.is_partitioned(p) for p in model.parameters())
    if accelerator.is_main_process:
        torch.save({"streamed": streamed, "whole": whole, "specs": specs, "most_alive": tracker.most,
                    "partitioned": partitioned}, out / "zero3_sent.pt")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
