"""The fields of TRL's (transformers') trainer config that choose a distributed engine, and why our
trainer config refuses them: the engine comes from the accelerate launch config (docs/distributed.md).
grpo_ascend/config/trl_fields.py classifies every other TRL field."""

from __future__ import annotations

_FROM_LAUNCH = ("DeepSpeed and FSDP2 are chosen from the accelerate launch config (accelerate launch --config_file "
                "recipes/accelerate/...; docs/distributed.md), not from the trainer config")

#: TRL field -> why a non-default value is refused (in TRL's field order).
ENGINE_FIELDS: dict[str, str] = {
    "fsdp": _FROM_LAUNCH,
    "fsdp_config": _FROM_LAUNCH,
    "deepspeed": _FROM_LAUNCH,
}
#: The TRL field the engine fields follow in TRL's order.
AFTER = "ddp_timeout"
#: Their declared TRL 1.16 defaults: no engine chosen by the trainer config.
ENGINE_DEFAULTS: dict[str, None] = dict.fromkeys(ENGINE_FIELDS)
