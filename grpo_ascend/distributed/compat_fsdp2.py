"""The FSDP2 internals grpo-ascend relies on, in one place (pinned to torch 2.13).

Rollouts call the policy below the sharded root, token by token. To keep every unit's weights
gathered across those forwards, FSDP2's per-group reshard-after-forward is switched off for the
duration and its forward bookkeeping cleared afterwards. torch has no public API for that, so
these private names are used: ``FSDPModule._get_fsdp_state()``, ``FSDPState._lazy_init()``,
``FSDPState._fsdp_param_groups``, ``FSDPState._comm_ctx.post_forward_order``,
``FSDPParamGroup.post_forward_mesh_info`` and ``FSDPParamGroup._post_forward_indices``.
tests/distributed/test_compat.py checks each on a real ``fully_shard`` model; a torch that renames one fails
there with :class:`CompatError` naming it, not deep inside a rollout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpo_ascend.errors import CompatError

#: The private attributes used here, as (owner, name) pairs; tests/distributed/test_compat.py checks each one.
PINNED_INTERNALS: tuple[tuple[str, str], ...] = (
    ("FSDPModule", "_get_fsdp_state"),
    ("FSDPState", "_lazy_init"),
    ("FSDPState", "_fsdp_param_groups"),
    ("FSDPState", "_comm_ctx"),
    ("FSDPCommContext", "post_forward_order"),
    ("FSDPParamGroup", "post_forward_mesh_info"),
    ("FSDPParamGroup", "_post_forward_indices"),
)


def internal(obj: Any, owner: str, name: str) -> Any:
    """``getattr(obj, name)``, or a CompatError naming the FSDP2 internal and the torch version."""
    try:
        return getattr(obj, name)
    except AttributeError as exc:
        raise CompatError(
            f"torch {torch.__version__} changed the FSDP2 internal {owner}.{name} that grpo-ascend uses to keep the "
            "weights gathered during rollouts; use torch 2.13 (or update grpo_ascend/distributed/compat_fsdp2.py)"
        ) from exc


def fsdp_modules(root: nn.Module) -> list[nn.Module]:
    """Every ``fully_shard`` unit under ``root`` (root included)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@dataclass
class _GroupState:
    group: Any
    mesh_info: Any
    indices: list[int]


@contextlib.contextmanager
def units_stay_gathered(root: nn.Module) -> Iterator[None]:
    """Every ``fully_shard`` unit under ``root`` holds its whole weights inside the block, across forwards.

    ``root`` is the unit ``fully_shard`` was applied to last; it is initialised first (FSDP2 picks
    its root lazily at the first forward, and rollouts enter below it). Each unit is gathered once
    with reshard-after-forward switched off; on exit that is restored, the forward records
    (prefetch order) of the no-grad decoding steps are cleared and every unit is resharded.
    """
    modules = fsdp_modules(root)
    if not modules:
        yield
        return
    state = internal(root, "FSDPModule", "_get_fsdp_state")()
    internal(state, "FSDPState", "_lazy_init")()
    saved = []
    for module in modules:
        for group in internal(internal(module, "FSDPModule", "_get_fsdp_state")(), "FSDPState", "_fsdp_param_groups"):
            saved.append(_GroupState(group, internal(group, "FSDPParamGroup", "post_forward_mesh_info"),
                                     internal(group, "FSDPParamGroup", "_post_forward_indices")))
    order = internal(internal(state, "FSDPState", "_comm_ctx"), "FSDPCommContext", "post_forward_order")
    try:
        for entry in saved:
            entry.group.post_forward_mesh_info = None  # = reshard_after_forward False
        for module in modules:
            module.unshard()
        yield
    finally:
        for entry in saved:
            entry.group.post_forward_mesh_info = entry.mesh_info
            entry.indices.clear()
        order.clear()
        for module in modules:
            module.reshard()
