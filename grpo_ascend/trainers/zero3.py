"""DeepSpeed ZeRO-3 for the trainers: gather the partitioned parameters where grpo-ascend needs them whole.

ZeRO-3 partitions every parameter over the ranks: on each rank ``param.data`` is empty and
DeepSpeed's module hooks all-gather a module's weights for its forward (and backward) and free
them afterwards. The training forward (:class:`~grpo_ascend.models.CompletionLogprobs` through
the engine) runs under those hooks unchanged. Three places need whole weights outside them:

- rollouts: the rollout engine decodes token by token on the policy itself; the whole policy is
  gathered once per round with DeepSpeed's hooks removed (:func:`whole_model_for_generation`),
  instead of an all-gather of every layer at every decoding step;
- checkpoint save: every rank takes part in gathering the trainable parameters, rank 0 writes
  the same adapter/model files as without DeepSpeed (:func:`gathered`);
- resume: the trainable parameters are gathered, every rank reads the same files into them and
  rank 0's values are partitioned back (``gathered(..., modifier_rank=0)``); the fp32 master
  partitions come back with each rank's optimizer shard.

Every function here is a no-op without ZeRO-3 (plain parameters), so callers need no branches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn


def zero_stage(accelerator: Any) -> int:
    """The ZeRO stage accelerate runs DeepSpeed with, 0 without DeepSpeed."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else 0


def is_partitioned(param: nn.Parameter) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter (DeepSpeed gives those a ``ds_id``)."""
    return hasattr(param, "ds_id")


def full_numel(param: nn.Parameter) -> int:
    """Element count of the whole parameter, partitioned or not."""
    return int(getattr(param, "ds_numel", param.numel()))


@contextlib.contextmanager
def gathered(params: Iterable[nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """Hold the ZeRO-3 partitioned ``params`` whole on every rank inside the block.

    Every rank must enter it (it all-gathers). ``modifier_rank=None``: read only, partitions are
    left as they were. ``modifier_rank=R``: rank R's values are broadcast and partitioned on exit
    (what a load does). Plain parameters pass through untouched.
    """
    params = [p for p in params if is_partitioned(p)]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield


@contextlib.contextmanager
def whole_model_for_generation(engine: Any) -> Iterator[None]:
    """The engine's model with every parameter gathered and ZeRO-3's module hooks removed, for rollouts.

    Uses DeepSpeed's own ``unwrap_model_for_generation`` (the hooks would free each layer's
    weights after its forward, gathering them again at every decoding step); the hooks are put
    back and the weights re-partitioned on exit. Costs one copy of the whole model per rank while
    active.
    """
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(engine):
        yield


def keep_gathered_per_forward(root: nn.Module, params: Iterable[nn.Parameter]) -> int:
    """Gather ``params`` once per forward of ``root`` instead of at every call of their own module.

    The log-prob forward calls the output head once per token chunk (and again per chunk in the
    backward's recompute); the number of chunks follows this rank's completion lengths. ZeRO-3
    gathers a module's weights collectively at each call, so ranks with different chunk counts
    would issue mismatched collectives. Registered as external parameters of ``root`` (and flagged
    as such, as DeepSpeed's own hooks flag parameters a module hands out), they are gathered when
    ``root``'s forward starts and stay whole until the optimizer step re-partitions everything.
    Returns how many parameters were registered (0 without ZeRO-3).
    """
    params = [p for p in params if is_partitioned(p)]
    if not params:
        return 0
    import deepspeed

    for param in params:
        deepspeed.zero.register_external_parameter(root, param)
        param.is_external_param = True
    return len(params)
