"""A decoder-only transformer's sizes for the memory plan, from a ``config.json`` or a built-in model (no weights).

:class:`ModelShape` counts parameters, LoRA elements, KV-cache bytes per token and a hybrid decoder's
recurrent state per row (:mod:`grpo_ascend.planning.recurrent_shape`);
:func:`load_model_shape` finds the config of a local folder, a ``builtin:*`` model or a hub id whose
published shape ships in recipes/model_configs (Qwen2.5 0.5B-72B). A vision-language config (one with a
``vision_config``) gives its text decoder's shape with the vision part in ``ModelShape.vision``
(:mod:`grpo_ascend.planning.vision_shape`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.tiny_model import OTHER_BUILTINS, builtin_architecture, resolve_builtin
from grpo_ascend.planning.recurrent_shape import RecurrentShape, recurrent_shape
from grpo_ascend.planning.vision_shape import VisionShape, full_config, text_config, vision_shape

#: config.json files of published models (Qwen2.5 0.5B-72B), used for their hub ids without a download.
MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "model_configs"
#: The linear layers of one decoder layer, as LoRA target names.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (Qwen2 / Llama style: GQA attention, gated MLP)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    dtype: str = "float32"
    #: A vision-language model's vision tower and projector (None: a text model).
    vision: VisionShape | None = None
    #: A hybrid decoder's recurrent layers (linear attention, Mamba2) and their per-row state (None: attention only).
    recurrent: RecurrentShape | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config") -> ModelShape:
        """From a ``config.json`` mapping (or a transformers config's ``to_dict()``)."""
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                vocab_size=int(config["vocab_size"]), hidden_size=hidden, num_layers=_num_layers(config),
                num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch."),
            )
        except KeyError as exc:
            raise ConfigError(f"{source}: the model config has no {exc.args[0]!r}; expected a decoder-only "
                              "transformer's config.json (hidden_size, num_hidden_layers, num_attention_heads, "
                              "intermediate_size, vocab_size)") from None

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by LoRA target name."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def layer_params(self) -> int:
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        return sum(a * b for a, b in self.linear_shapes().values()) + bias + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Parameters of the output head that are not the embedding's (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.embedding_params

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.head_params + self.num_layers * self.layer_params + self.hidden_size

    def lora_params(self, r: int, targets: tuple[str, ...] | None) -> int:
        """LoRA A and B elements over every layer (``targets`` None = every linear but the head)."""
        chosen = LINEARS if targets is None else targets
        return self.num_layers * sum(r * (a + b) for name, (a, b) in self.linear_shapes().items() if name in chosen)

    def adapted_linear_params(self, targets: tuple[str, ...] | None) -> int:
        chosen = LINEARS if targets is None else targets
        return self.num_layers * sum(a * b for name, (a, b) in self.linear_shapes().items() if name in chosen)

    @property
    def attention_layers(self) -> int:
        """Layers that keep keys and values (every layer but a hybrid decoder's recurrent and MLP-only ones)."""
        return self.num_layers if self.recurrent is None else self.recurrent.attention_layers

    def kv_bytes_per_token(self, activation_bytes: int) -> int:
        """Keys + values of one token over every attention layer."""
        return 2 * self.attention_layers * self.num_kv_heads * self.head_dim * activation_bytes

    def state_bytes_per_row(self, activation_bytes: int) -> int:
        """A hybrid decoder's recurrent state of one row (convolution windows and recurrent states); 0 otherwise."""
        return 0 if self.recurrent is None else self.recurrent.bytes_per_row(activation_bytes)


def _num_layers(config: Mapping[str, Any]) -> int:
    """``num_hidden_layers``, else the length of the layer list a hybrid config names (NemotronH's ``layers_block_type``)."""
    named = config.get("layer_types") or config.get("layers_block_type")
    return int(config["num_hidden_layers"]) if "num_hidden_layers" in config or not named else len(named)


def load_model_shape(model: str, model_config: str | Path | None = None,
                     image_size: tuple[int, int] | None = None) -> ModelShape:
    """The shape of ``model`` without loading weights: ``model_config`` (a config.json or its folder) if
    given, else ``builtin:*`` sizes, else ``model``'s own config.json when it is a local folder, else the
    config shipped in recipes/model_configs for a known hub id (``Qwen/Qwen2.5-7B-Instruct``).

    ``builtin:vlm-*`` is built (a few seconds, cached) for its config and processor. ``image_size`` (width,
    height): the images a vision-language model's plan counts (default: its processor's largest)."""
    builtin = model_config is None and model.startswith("builtin:")
    if builtin and model.removeprefix("builtin:").partition("-")[0] not in OTHER_BUILTINS:
        return ModelShape.from_config(builtin_architecture(model), model)
    path = Path(resolve_builtin(model) if builtin else model_config if model_config is not None else model)  # type: ignore[arg-type]
    known = MODEL_CONFIGS / f"{model.rpartition('/')[2].lower().removesuffix('-instruct')}.json"
    if model_config is None and not path.exists() and known.is_file():
        path = known  # a hub id whose shape ships with grpo-ascend
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json for model {model!r} at {str(path)!r}: pass --model-config PATH "
                          "(a config.json, e.g. recipes/model_configs/qwen2.5-7b.json) or a local model folder")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
    return shape_of_config(config, str(path), path.parent, image_size)


def shape_of_config(config: Mapping[str, Any], source: str = "config", folder: Path | None = None,
                    image_size: tuple[int, int] | None = None) -> ModelShape:
    """A ``config.json`` mapping (or a loaded model's ``config.to_dict()``) as a shape: a text model's, or a
    vision-language model's with its vision part (``folder``: where its processor's settings are)."""
    if config.get("vision_config") is None:
        return dataclasses.replace(ModelShape.from_config(config, source), recurrent=recurrent_shape(config, source))
    return vision_language_shape(config, source, folder, image_size)


def vision_language_shape(raw: Mapping[str, Any], source: str, folder: Path | None = None,
                          image_size: tuple[int, int] | None = None) -> ModelShape:
    """A vision-language config's text decoder shape with its vision part (``folder``: the processor's settings)."""
    config = full_config(raw, source)
    text = text_config(config)
    shape = ModelShape.from_config(text, source)
    return dataclasses.replace(shape, vision=vision_shape(config, folder, image_size),
                               recurrent=recurrent_shape(text, source))  # Qwen3.5's hybrid decoder


def lora_targets(target_modules: Any) -> tuple[str, ...] | None:
    """A LoRA config's target modules as the plan's targets: None when every decoder linear is adapted."""
    if target_modules is None or target_modules == "all-linear":
        return None
    if isinstance(target_modules, str):  # one name, or a regex such as a vision-language model's LoRA targets
        chosen = tuple(name for name in LINEARS if name in target_modules)
    else:
        chosen = tuple(name for name in LINEARS if name in set(target_modules))
    return None if len(chosen) == len(LINEARS) else chosen


def dtype_bytes(name: str) -> int:
    if name not in _DTYPE_BYTES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]
