"""On-device rollout ring buffer: order across wrap-around, sampling, clear, clear errors."""

from __future__ import annotations

import pytest
import torch

from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.examples_support.pendulum.buffer import FieldSpec, RolloutBuffer


def make(capacity: int = 5) -> RolloutBuffer:
    return RolloutBuffer(
        capacity,
        {"obs": FieldSpec((3,), torch.float32), "ids": ((2,), torch.int64), "reward": ((), torch.float32)},
    )


def items(start: int, n: int) -> dict[str, torch.Tensor]:
    k = torch.arange(start, start + n)
    return {
        "obs": k.float().unsqueeze(1).repeat(1, 3),
        "ids": torch.stack([k, -k], dim=1),
        "reward": k.float() * 0.5,
    }


def test_fill_and_wrap_around_keep_insertion_order():
    buf = make(5)
    assert buf.size == 0 and not buf.full and len(buf) == 0
    buf.add(**items(0, 3))
    assert buf.size == 3 and not buf.full
    assert buf.all()["ids"][:, 0].tolist() == [0, 1, 2]
    buf.add(**items(3, 4))  # wraps: 0 and 1 are overwritten
    assert buf.full and buf.size == 5
    out = buf.all()
    assert out["ids"][:, 0].tolist() == [2, 3, 4, 5, 6]
    assert out["ids"][:, 1].tolist() == [-2, -3, -4, -5, -6]
    assert out["reward"].tolist() == [1.0, 1.5, 2.0, 2.5, 3.0]
    assert out["obs"].shape == (5, 3) and out["obs"].dtype == torch.float32
    assert buf.get([0, -1])["ids"][:, 0].tolist() == [2, 6]
    assert buf.get(torch.tensor([4, 1]))["ids"][:, 0].tolist() == [6, 3]


def test_batch_larger_than_capacity_keeps_the_newest():
    buf = make(4)
    buf.add(**items(0, 2))
    buf.add(**items(2, 7))
    assert buf.all()["ids"][:, 0].tolist() == [5, 6, 7, 8]
    buf.add(**items(9, 1))
    assert buf.all()["ids"][:, 0].tolist() == [6, 7, 8, 9]


def test_returned_tensors_are_copies():
    buf = make(3)
    buf.add(**items(0, 3))
    out = buf.all()
    out["reward"].zero_()
    assert buf.all()["reward"].tolist() == [0.0, 0.5, 1.0]


def test_sampling_is_reproducible_with_seeded_generator():
    buf = make(8)
    buf.add(**items(0, 6))
    buf.add(**items(6, 5))  # wrapped
    a = buf.sample(4, torch.Generator().manual_seed(7))
    b = buf.sample(4, torch.Generator().manual_seed(7))
    c = buf.sample(4, torch.Generator().manual_seed(8))
    assert torch.equal(a["ids"], b["ids"]) and not torch.equal(a["ids"], c["ids"])
    held = set(buf.all()["ids"][:, 0].tolist())
    assert set(a["ids"][:, 0].tolist()) <= held and len(set(a["ids"][:, 0].tolist())) == 4
    # Fields of one sampled item stay aligned.
    assert torch.equal(a["obs"][:, 0].long(), a["ids"][:, 0])
    r = buf.sample(20, torch.Generator().manual_seed(0), replacement=True)
    assert r["ids"].shape == (20, 2) and set(r["ids"][:, 0].tolist()) <= held


def test_clear_reuses_storage():
    buf = make(3)
    buf.add(**items(0, 3))
    buf.clear()
    assert buf.size == 0 and buf.all()["ids"].shape == (0, 2)
    buf.add(**items(10, 2))
    assert buf.all()["ids"][:, 0].tolist() == [10, 11]


def test_errors_name_the_field_and_the_problem():
    buf = make(3)
    good = items(0, 2)
    with pytest.raises(DataError, match=r"field 'obs': expected dtype torch.float32, got torch.float64"):
        buf.add(**{**good, "obs": good["obs"].double()})
    with pytest.raises(DataError, match=r"field 'obs': expected shape \[n, 3\], got \[2, 4\]"):
        buf.add(**{**good, "obs": torch.zeros(2, 4)})
    with pytest.raises(DataError, match=r"field 'reward': expected shape \[n\], got \[2, 1\]"):
        buf.add(**{**good, "reward": torch.zeros(2, 1)})
    with pytest.raises(DataError, match=r"missing fields \['reward'\], unknown fields \['rewards'\]"):
        buf.add(obs=good["obs"], ids=good["ids"], rewards=good["reward"])
    with pytest.raises(DataError, match="has 1 items but other fields have 2"):
        buf.add(**{**good, "reward": torch.zeros(1)})
    with pytest.raises(DataError, match="empty"):
        buf.sample(1)
    buf.add(**good)
    with pytest.raises(DataError, match="exceeds the 2 items held"):
        buf.sample(3)
    with pytest.raises(DataError, match="out of range"):
        buf.get([2])
    with pytest.raises(ConfigError, match="capacity"):
        RolloutBuffer(0, {"x": ((), torch.float32)})
    with pytest.raises(ConfigError, match="field 'x'"):
        RolloutBuffer(2, {"x": "float"})  # type: ignore[dict-item]
