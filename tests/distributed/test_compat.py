"""One check per pinned private internal of torch FSDP2, DeepSpeed, accelerate and peft.

Each compat module (grpo_ascend/distributed/compat_*.py, grpo_ascend/models/compat_peft.py) lists the internals
it relies on; a library version that changes one fails here with a CompatError naming it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from grpo_ascend.distributed import compat_accelerate, compat_deepspeed, compat_fsdp2
from grpo_ascend.errors import CompatError
from grpo_ascend.models import compat_peft, compat_transformers


@pytest.mark.parametrize("name", sorted(compat_peft.PINNED_INTERNALS))
def test_peft_internal_is_present(name):
    compat_peft.PINNED_INTERNALS[name]()


@pytest.mark.parametrize("name", sorted(compat_transformers.PINNED_INTERNALS))
def test_transformers_internal_is_present(name):
    compat_transformers.PINNED_INTERNALS[name]()


@pytest.mark.parametrize("name", sorted(compat_accelerate.PINNED_INTERNALS))
def test_accelerate_internal_is_present(name):
    compat_accelerate.PINNED_INTERNALS[name]()


@pytest.mark.parametrize("name", sorted(compat_deepspeed.PINNED_INTERNALS))
def test_deepspeed_internal_is_present(name):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    compat_deepspeed.PINNED_INTERNALS[name]()


@pytest.fixture(scope="module")
def sharded_model():
    """A two-unit ``fully_shard`` model in a one-process gloo group (torn down afterwards)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    yield model
    if started:
        dist.destroy_process_group()


def _owners(root: nn.Module) -> dict[str, object]:
    state = root._get_fsdp_state()
    return {"FSDPModule": root, "FSDPState": state, "FSDPCommContext": state._comm_ctx,
            "FSDPParamGroup": root[0]._get_fsdp_state()._fsdp_param_groups[0]}


@pytest.mark.parametrize(("owner", "name"), compat_fsdp2.PINNED_INTERNALS)
def test_fsdp2_internal_is_present(sharded_model, owner, name):
    state = sharded_model._get_fsdp_state()
    state._lazy_init()
    compat_fsdp2.internal(_owners(sharded_model)[owner], owner, name)


def test_units_stay_gathered_across_forwards_and_reshard_after(sharded_model):
    from torch.distributed.tensor import DTensor

    x = torch.randn(3, 4)
    expected = sharded_model(x)
    inner = sharded_model[0]
    with torch.no_grad(), compat_fsdp2.units_stay_gathered(sharded_model):
        assert not isinstance(inner.weight, DTensor)  # whole, unsharded
        torch.testing.assert_close(sharded_model[1](inner(x)), expected)  # below the root, twice
        torch.testing.assert_close(sharded_model[1](inner(x)), expected)
        assert not isinstance(inner.weight, DTensor)
    assert isinstance(inner.weight, DTensor)


def test_a_changed_internal_is_named(monkeypatch):
    import accelerate.utils

    with pytest.raises(CompatError, match=r"FSDP2 internal FSDPParamGroup.post_forward_mesh_info"):
        compat_fsdp2.internal(object(), "FSDPParamGroup", "post_forward_mesh_info")
    plugin = type("FullyShardedDataParallelPlugin", (), {})  # an accelerate whose plugin lost a method
    monkeypatch.setattr(accelerate.utils, "FullyShardedDataParallelPlugin", plugin)
    with pytest.raises(CompatError, match=r"accelerate .* changed FullyShardedDataParallelPlugin.set_mixed_precision"):
        compat_accelerate.PINNED_INTERNALS["FullyShardedDataParallelPlugin.set_mixed_precision"]()
