"""What a model is under its wrappers: DDP / DataParallel / torch.compile stripped, and whether it is a PeftModel.

The bottom of the model helpers: checkpoints, export, the policy and the critic all ask these.
"""

from __future__ import annotations

import sys

from torch import nn


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` itself is a ``peft.PeftModel`` (unwrap DDP/compile wrappers first).

    A model can only be one if peft was imported, so a full fine-tuning run never imports peft here.
    """
    peft = sys.modules.get("peft")
    peft_model = getattr(peft, "PeftModel", None) if peft is not None else None
    return peft_model is not None and isinstance(model, peft_model)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DistributedDataParallel/DataParallel and torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model
