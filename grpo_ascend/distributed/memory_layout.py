"""Where each distributed engine keeps a run's state, as the memory plan needs it (no engine is started).

:class:`MemoryLayout` says, for one engine and process count, which of weights, gradients and
optimizer state are split over the ranks and what extra copies the engine holds. It comes from
an accelerate config file (:func:`layout_from_accelerate_config`, for ``grpo-ascend plan``) or
from a running strategy (:meth:`grpo_ascend.distributed.base.Strategy.memory_layout`, for
``max_tokens_per_micro_batch: auto``); :mod:`grpo_ascend.planning.terms` turns it into bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grpo_ascend.errors import ConfigError

#: DeepSpeed's default reduce_bucket_size (elements): the most a ZeRO-2/3 gradient reduction buffer holds.
DEEPSPEED_REDUCE_BUCKET = 500_000_000
#: DeepSpeed's default stage3_max_live_parameters and stage3_max_reuse_distance (elements): ZeRO-3 keeps a
#: gathered parameter whole while it is used again within this many elements of the forward/backward order.
DEEPSPEED_LIVE_PARAMETERS = 1_000_000_000


@dataclass(frozen=True)
class MemoryLayout:
    """How one engine spreads weights, gradients and optimizer state over ``world_size`` ranks."""

    #: The strategy (distributed engine) by name, for messages: "single process", "DDP", "DeepSpeed ZeRO-3", "FSDP2".
    strategy_name: str = "single process"
    world_size: int = 1
    #: ZeRO-3 / FSDP2: each rank holds 1/world of the weights (whole during generation).
    shards_weights: bool = False
    #: ZeRO-2/3 / FSDP2: each rank holds 1/world of the gradients after reduction.
    shards_gradients: bool = False
    #: ZeRO-1/2/3 / FSDP2: each rank holds 1/world of the optimizer state.
    shards_optimizer: bool = False
    #: DeepSpeed's optimizer keeps an fp32 master copy of its partition beside the Adam moments.
    fp32_master_weights: bool = False
    #: DDP: its reduction buckets hold every gradient a second time.
    gradient_buckets: bool = False
    #: DeepSpeed: the gradient reduction buffer holds up to this many elements (0: none).
    reduce_bucket_elements: int = 0
    #: ZeRO-3: the output head (and a tied embedding) is gathered whole in each forward (in training, to the step).
    whole_head_in_training: bool = False
    #: ZeRO-3: besides the head, up to this many elements of other weights stay gathered in a forward (0: none).
    live_gathered_elements: int = 0
    #: LoRA may be folded into the weights for generation (the engine owns them otherwise).
    may_merge_lora: bool = True
    #: Full fine-tuning is refused under this engine (ZeRO-3).
    refuses_full_fine_tuning: bool = False

    def describe(self) -> str:
        return self.strategy_name if self.world_size == 1 else f"{self.strategy_name}, {self.world_size} processes"


def plain_layout(world_size: int) -> MemoryLayout:
    """One process, or DDP over ``world_size`` (every rank holds everything; DDP buckets hold the gradients again)."""
    if world_size <= 1:
        return MemoryLayout()
    return MemoryLayout(strategy_name="DDP", world_size=world_size, gradient_buckets=True)


def deepspeed_layout(stage: int, world_size: int) -> MemoryLayout:
    """DeepSpeed ZeRO-``stage`` over ``world_size`` ranks."""
    if stage not in (1, 2, 3):
        raise ConfigError(f"DeepSpeed zero_stage {stage} is not supported; use 1, 2 or 3")
    return MemoryLayout(
        strategy_name=f"DeepSpeed ZeRO-{stage}", world_size=world_size, shards_weights=stage == 3,
        shards_gradients=stage >= 2, shards_optimizer=True, fp32_master_weights=True,
        reduce_bucket_elements=DEEPSPEED_REDUCE_BUCKET,
        whole_head_in_training=stage == 3, live_gathered_elements=DEEPSPEED_LIVE_PARAMETERS if stage == 3 else 0,
        may_merge_lora=stage < 3, refuses_full_fine_tuning=stage == 3,
    )


def fsdp_layout(world_size: int) -> MemoryLayout:
    """FSDP2 (fully_shard per decoder layer) over ``world_size`` ranks."""
    return MemoryLayout(strategy_name="FSDP2", world_size=world_size, shards_weights=True, shards_gradients=True,
                        shards_optimizer=True, may_merge_lora=False)


def _zero_stage(config: dict[str, Any], source: Path) -> int:
    ds = config.get("deepspeed_config") or {}
    if "zero_stage" in ds:
        return int(ds["zero_stage"])
    file = ds.get("deepspeed_config_file")
    if file:
        path = Path(file) if Path(file).is_absolute() else source.parent / file
        try:
            return int(json.loads(path.read_text()).get("zero_optimization", {}).get("stage", 0))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{source}: could not read the DeepSpeed config {str(path)!r}: {exc}") from exc
    raise ConfigError(f"{source}: distributed_type DEEPSPEED without deepspeed_config.zero_stage or a "
                      "deepspeed_config_file naming zero_optimization.stage")


def layout_from_accelerate_config(path: str | Path | None, num_processes: int | None = None) -> MemoryLayout:
    """The layout an ``accelerate launch --config_file PATH`` run gets; ``num_processes`` overrides the file's.

    No file: one process, or DDP when ``num_processes`` > 1 (``grpo-ascend train --num_processes N``).
    """
    if path is None:
        return plain_layout(num_processes or 1)
    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"accelerate config not found: {str(source)!r}")
    config = yaml.safe_load(source.read_text()) or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected an accelerate config mapping, got {type(config).__name__}")
    world = int(num_processes or config.get("num_processes") or 1)
    if world < 1:
        raise ConfigError(f"num_processes must be >= 1, got {world}")
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind == "DEEPSPEED":
        return deepspeed_layout(_zero_stage(config, source), world)
    if kind == "FSDP":
        version = int((config.get("fsdp_config") or {}).get("fsdp_version", 1))
        if version != 2:
            raise ConfigError(f"{source}: fsdp_version {version} is not supported; grpo-ascend runs FSDP2 (fsdp_version: 2)")
        return fsdp_layout(world)
    return plain_layout(world)


def sharding_alternatives(layout: MemoryLayout, use_peft: bool) -> list[tuple[str, MemoryLayout]]:
    """Engines that shard more than ``layout`` on the same ranks, with the accelerate config that launches them
    (ZeRO-3 for LoRA: full fine-tuning is refused there; FSDP2 for full fine-tuning)."""
    if layout.world_size <= 1:
        return []
    out = []
    if use_peft and not layout.shards_weights:
        out.append(("DeepSpeed ZeRO-3 (recipes/accelerate/deepspeed_zero3.yaml)", deepspeed_layout(3, layout.world_size)))
    if not use_peft and not layout.shards_optimizer:
        out.append(("FSDP2 (recipes/accelerate/fsdp2_1node_8cards.yaml)", fsdp_layout(layout.world_size)))
    return out
