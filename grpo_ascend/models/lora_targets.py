"""What ``target_modules="all-linear"`` means for models whose linear layers PEFT does not all take.

PEFT 0.21 refuses LoRA on the ``out_proj`` (and ``conv1d``) of Mamba-based model types, which its own
``all-linear`` selects; for those, ``all-linear`` becomes every other linear layer (never the output head).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

#: model_type -> module names PEFT refuses LoRA on (peft/tuners/tuners_utils.py's Mamba check).
REFUSED_LORA_MODULES: dict[str, frozenset[str]] = {
    model_type: frozenset({"out_proj", "conv1d"})
    for model_type in ("nemotron_h", "falcon_h1", "mamba", "mamba2", "falcon_mamba")
}


def all_linear_targets(model: nn.Module) -> str | None:
    """A PEFT ``target_modules`` regex for ``all-linear`` without the modules PEFT refuses on ``model``'s type;
    None where PEFT's own ``all-linear`` works."""
    refused = REFUSED_LORA_MODULES.get(getattr(getattr(model, "config", None), "model_type", None) or "")
    if refused is None:
        return None
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and "lm_head" not in name and name.rsplit(".", 1)[-1] not in refused]
    return "|".join(re.escape(n) for n in names)


def is_all_linear(target_modules: Any) -> bool:
    """Whether a PEFT ``target_modules`` asks for every linear layer."""
    return target_modules in ("all-linear", {"all-linear"}, ["all-linear"])
