"""A hybrid decoder's recurrent layers for the memory plan: how many, and the state each keeps per row.

A linear-attention or Mamba2 layer keeps no keys/values per token but, per row, its convolution window
(``channels × kernel`` elements in the activation dtype) and its recurrent state (float32 in transformers'
scans). The families' geometry is read from their config, through transformers' config class (which derives
``layer_types`` from a hub config's own fields, e.g. Qwen3-Next's ``full_attention_interval``), in a registry
keyed by ``model_type``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.layer_kinds import ATTENTION, RECURRENT, layer_kinds, text_decoder_config

#: Bytes per element of a recurrent state: transformers' scans carry it in float32 whatever the model's dtype.
RECURRENT_STATE_BYTES = 4


@dataclass(frozen=True)
class RecurrentShape:
    """The decoder's recurrent layers: their count, the attention layers beside them, one row's state per layer."""

    recurrent_layers: int
    attention_layers: int
    conv_elements: int
    state_elements: int

    def bytes_per_row(self, activation_bytes: int) -> int:
        """Convolution windows (activation dtype) and recurrent states (float32) of one row over every recurrent layer."""
        return self.recurrent_layers * (self.conv_elements * activation_bytes + self.state_elements * RECURRENT_STATE_BYTES)


def _gated_delta_net(c: Any) -> tuple[int, int]:
    """Qwen3-Next / Qwen3.5: the convolution runs over queries, keys and values; the state is value heads × k × v."""
    keys = c.linear_num_key_heads * c.linear_key_head_dim
    values = c.linear_num_value_heads * c.linear_value_head_dim
    return (2 * keys + values) * c.linear_conv_kernel_dim, c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim


def _mamba2(c: Any) -> tuple[int, int]:
    """NemotronH: the convolution runs over x, B and C; the state is heads × head dim × state size."""
    channels = c.mamba_num_heads * c.mamba_head_dim + 2 * c.n_groups * c.ssm_state_size
    return channels * c.conv_kernel, c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size


#: model_type -> (convolution elements, recurrent-state elements) of one row in one recurrent layer.
RECURRENT_GEOMETRY: dict[str, Callable[[Any], tuple[int, int]]] = {
    "qwen3_next": _gated_delta_net,
    "qwen3_5_text": _gated_delta_net,
    "qwen3_5_moe_text": _gated_delta_net,
    "nemotron_h": _mamba2,
}


def _plain_floats(value: Any) -> Any:
    """``value`` with transformers' JSON tags for non-finite floats (``{"__float__": "Infinity"}``, as a saved
    config.json holds Mamba2's ``time_step_limit``) turned back into floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and isinstance(value["__float__"], str):
            return float(value["__float__"])
        return {k: _plain_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_floats(v) for v in value]
    return value


def recurrent_shape(config: Mapping[str, Any], source: str = "config") -> RecurrentShape | None:
    """The recurrent layers of a ``config.json`` mapping, or None for a decoder of attention layers only."""
    model_type = config.get("model_type")
    if model_type not in RECURRENT_GEOMETRY:
        return None
    from transformers import AutoConfig

    try:
        fields = {k: _plain_floats(v) for k, v in config.items() if k != "model_type"}
        text = text_decoder_config(AutoConfig.for_model(model_type, **fields))
        kinds = layer_kinds(text)
        conv, state = RECURRENT_GEOMETRY[model_type](text)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{source}: a {model_type} config the plan cannot read ({exc}); expected its config.json "
                          "as transformers writes it") from None
    return RecurrentShape(recurrent_layers=kinds.count(RECURRENT), attention_layers=kinds.count(ATTENTION),
                          conv_elements=conv, state_elements=state)
