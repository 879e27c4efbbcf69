"""The transformers internals grpo-ascend relies on, in one place (pinned to transformers 5.25).

A model unpickled in another process (the rollout process's copy of the policy) skips
``PreTrainedModel.__init__``, which registers each model class's recordable outputs
(``_can_record_outputs``) in ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY``. Without that
entry the model's hooks record nothing, and a vision tower read through ``hidden_states`` (LLaVA's
``vision_feature_layer``) gets None. :func:`register_unpickled` restores the entries.
:data:`PINNED_INTERNALS` probes the registry; tests/distributed/test_compat.py runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from grpo_ascend.errors import CompatError


def _registry() -> Any:
    import transformers
    from transformers.utils import output_capturing

    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    if registry is None:
        raise CompatError(f"transformers {transformers.__version__} has no output_capturing._CAN_RECORD_REGISTRY, which "
                          "grpo-ascend re-fills for a model unpickled in the rollout process; use transformers 5.25 "
                          "(or update grpo_ascend/models/compat_transformers.py)")
    return registry


def register_unpickled(model: nn.Module) -> None:
    """Register the recordable outputs of every transformers model inside ``model`` (see the module docstring)."""
    from transformers import PreTrainedModel

    registry = _registry()
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            registry[module] = module._can_record_outputs


def _probe_registry() -> None:
    from transformers import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=16))
    if _registry().get(model) != model._can_record_outputs:
        raise CompatError("transformers changed how _CAN_RECORD_REGISTRY is keyed; update "
                          "grpo_ascend/models/compat_transformers.py")


#: name -> probe; each raises CompatError naming the internal when the installed transformers changed it.
PINNED_INTERNALS: dict[str, Callable[[], Any]] = {"output_capturing._CAN_RECORD_REGISTRY": _probe_registry}
