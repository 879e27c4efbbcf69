"""Sharded training streams its weights one tensor at a time: FSDP2 on two gloo processes sends, over a transfer
group, exactly the bytes unsharded training of the same model sends after the same optimizer step, and no rank
holds more than two whole tensors at once (the one being packed and the one before it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed_runs import run_ranks
from sharded_send_model import BUCKET_BYTES, VARIANTS, stepped_model

from grpo_ascend.rollout.policy_weights import PolicyWeights

WORKER = Path(__file__).resolve().parents[1] / "support" / "sharded_send_worker.py"
ZERO3_WORKER = WORKER.with_name("zero3_send_worker.py")


@pytest.fixture(scope="module")
def sharded_sends(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sharded_send")
    run_ranks([str(WORKER), str(out)], out, "log_sharded_send", timeout=180)
    return torch.load(out / "sent.pt")


@pytest.mark.parametrize("variant", VARIANTS)
def test_fsdp2_sends_the_bytes_of_unsharded_training(sharded_sends, variant):
    sent = sharded_sends[variant]
    assert sent["dtensors"] > 0  # the ranks really trained sharded
    expected = dict(PolicyWeights(stepped_model(variant), 1).named_tensors())
    got = sent["received"]
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
    initial = dict(stepped_model(variant, steps=0).state_dict())
    assert any(not torch.equal(initial[name], tensor) for name, tensor in expected.items())  # the step moved them


@pytest.mark.parametrize("variant", VARIANTS)
def test_fsdp2_never_holds_more_than_two_whole_tensors(sharded_sends, variant):
    sent = sharded_sends[variant]
    sizes = sorted(t.numel() * t.element_size() for t in sent["received"].values())
    assert 0 < sent["most_alive"] <= sizes[-1] + sizes[-2] <= BUCKET_BYTES + sizes[-1]
    assert sent["most_alive"] < sum(sizes) / 4  # never the whole model


def test_zero3_streams_each_partitioned_parameter_alone_with_the_whole_models_bytes(tmp_path):
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds_zero3.json"  # every parameter partitioned (none kept whole as 'persistent')
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                  "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}))
    run_ranks([str(ZERO3_WORKER), str(tmp_path)], tmp_path, "log_zero3_send", timeout=240,
              extra_env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)})
    sent = torch.load(tmp_path / "zero3_sent.pt")
    assert sent["partitioned"] > 0
    streamed, whole = sent["streamed"], sent["whole"]
    assert list(streamed) == list(whole) == [name for name, _, _ in sent["specs"]]
    for name, tensor in whole.items():
        assert tuple(tensor.shape) == next(shape for n, _, shape in sent["specs"] if n == name), name
        assert torch.equal(streamed[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
    sizes = sorted(t.numel() * t.element_size() for t in whole.values())
    assert 0 < sent["most_alive"] <= sizes[-1] + sizes[-2] and sent["most_alive"] < sum(sizes) / 4


class _CountingStrategy:
    """Stands for a sharded strategy: counts the tensors it was asked to make whole."""

    def __init__(self) -> None:
        self.gathered = 0

    def full_shape(self, tensor: torch.Tensor) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def stream_whole(self, named):
        for name, tensor in named:
            self.gathered += 1
            yield name, tensor.detach()


def test_a_streamed_sync_is_one_pass_on_every_rank_and_planning_it_gathers_nothing():
    model = stepped_model("untied", steps=0)
    count = len(model.state_dict())
    strategy = _CountingStrategy()
    weights = PolicyWeights(model, 1, whole=strategy, sends=False)
    assert [n for n, _, _ in weights.tensor_specs()] == list(model.state_dict()) and strategy.gathered == 0
    weights.complete()  # a rank whose backend took nothing still takes part in every gather
    assert strategy.gathered == count
    weights.complete()
    assert strategy.gathered == count  # once per sync
    sent = PolicyWeights(model, 2, whole=strategy)
    stream = sent.named_tensors()
    for _ in range(count):  # a consumer that takes exactly every tensor (the sender) counts as the pass
        next(stream)
    sent.complete()
    assert strategy.gathered == 2 * count
