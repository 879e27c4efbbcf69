"""What each decoder layer keeps between forwards, by the layer type its config names.

transformers names a decoder's layers in ``config.layer_types`` (NemotronH also as ``layers_block_type``):
``full_attention`` / ``sliding_attention`` layers keep keys and values per token, ``linear_attention``
layers (Qwen3-Next's and Qwen3.5's gated DeltaNet, NemotronH's Mamba2 mixer) keep a fixed-size state per
row (a convolution window and a recurrent state), ``moe`` / ``mlp`` blocks keep nothing. The rollout
engine's cache, the log-prob forward's prompt cache and the memory plan all ask this one registry.
"""

from __future__ import annotations

from typing import Any

from grpo_ascend.errors import ConfigError

ATTENTION = "attention"
RECURRENT = "recurrent"
STATELESS = "stateless"

#: Layer type (as a config names it) -> what the layer keeps between forwards.
LAYER_KINDS: dict[str, str] = {
    "full_attention": ATTENTION,
    "sliding_attention": ATTENTION,
    "linear_attention": RECURRENT,
    "moe": STATELESS,
    "mlp": STATELESS,
}


def text_decoder_config(config: Any) -> Any:
    """The text decoder's config of a model config (a vision-language model's language part, else itself)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def decoder_layer_types(config: Any) -> list[str]:
    """The decoder's layer types: ``layer_types``, else ``layers_block_type``, else full attention throughout."""
    text = text_decoder_config(config)
    named = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    return list(named) if named else ["full_attention"] * int(text.num_hidden_layers)


def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's kind (:data:`ATTENTION`, :data:`RECURRENT`, :data:`STATELESS`); raises on an unknown type."""
    types = decoder_layer_types(config)
    unknown = sorted({t for t in types if t not in LAYER_KINDS})
    if unknown:
        raise ConfigError(
            f"decoder layer types {unknown} are not supported (known: {sorted(LAYER_KINDS)}); the built-in rollout "
            "engine samples attention, linear-attention and Mamba2 layers. Sample this model with vLLM "
            "(use_vllm: true) or add its layer type to grpo_ascend/models/layer_kinds.py with a cache layer for it.")
    kinds = [LAYER_KINDS[t] for t in types]
    if any(kind != ATTENTION for kind in kinds) and not hybrid_caches_available():
        import transformers

        raise ConfigError(
            f"this decoder has {sorted(set(types) - {'full_attention', 'sliding_attention'})} layers, whose caches need "
            f"transformers >= 5.25 (installed: {transformers.__version__}); upgrade with "
            "`pip install -U 'transformers>=5.25'`, or sample it with vLLM (use_vllm: true)")
    if RECURRENT in kinds and ATTENTION not in kinds:
        raise ConfigError(
            "a decoder without any attention layer (only recurrent layers) is not supported: its model class reads "
            "no attention cache; sample it with vLLM (use_vllm: true)")
    return kinds


def hybrid_caches_available() -> bool:
    """Whether the installed transformers has the cache layers of hybrid decoders (linear-attention state, no state)."""
    from transformers import cache_utils

    return hasattr(cache_utils, "DummyLayer") and hasattr(cache_utils, "LinearAttentionCacheLayerMixin")


def has_recurrent_layers(config: Any) -> bool:
    """Whether any decoder layer keeps a recurrent state (a hybrid decoder)."""
    return RECURRENT in layer_kinds(config)
