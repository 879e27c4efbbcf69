"""Sharded training streams its weights one tensor at a time: FSDP2 on two gloo processes sends, over a transfer
group, exactly the bytes unsharded training of the same model sends after the same optimizer step, and no rank
holds more than two whole tensors at once (the one being packed and the one before it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed_runs import run_ranks
from sharded_send_model import BUCKET_BYTES, VARIANTS, stepped_model

from grpo_ascend.rollout.backend import PolicyWeights

WORKER = Path(__file__).resolve().parents[1] / "support" / "sharded_send_worker.py"


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
