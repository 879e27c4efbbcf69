"""A recipe: the flat YAML file (plus ``--key value`` overrides) that names a model, LoRA, data and rewards
(:class:`RecipeConfig`) and the trainer settings (a ``GRPOConfig`` or ``PPOConfig``), split by ``load_recipe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo_ascend.config.configs import BaseRLConfig, GRPOConfig, PPOConfig
from grpo_ascend.config.fields import _f, _positive, _unknown_key, _Validated
from grpo_ascend.errors import ConfigError


@dataclass
class RecipeConfig(_Validated):
    """What a recipe adds around the trainer config: model, LoRA, dataset and rewards."""

    algorithm: Literal["grpo", "ppo"] = _f("grpo", "Which trainer runs the recipe.")
    model: str = _f("builtin:tiny-warm", "Model path or hub id; builtin:tiny, builtin:tiny-warm, builtin:small are offline.")
    model_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f("float32", "Dtype the policy weights load in.")
    use_peft: bool = _f(True, "Train a LoRA adapter (true) or the full model (false).")
    lora_r: int = _f(16, "LoRA rank.")
    lora_alpha: int = _f(32, "LoRA alpha (scaling = alpha / r).")
    lora_dropout: float = _f(0.0, "LoRA dropout.")
    lora_target_modules: str | list[str] = _f("all-linear", "Modules that get adapters ('all-linear' = every linear but the head).")
    dataset: str = _f("synthetic:arithmetic", "Hub id, local .json/.jsonl/.parquet/.csv file, or synthetic:arithmetic.")
    dataset_config: str | None = _f(None, "Dataset configuration name (hub datasets).")
    dataset_split: str = _f("train", "Split to train on.")
    dataset_kwargs: dict[str, Any] = _f({}, "Options for the synthetic task: n, max_operand, ops, seed.")
    prompt_column: str = _f("prompt", "Column holding the prompt (text or chat messages).")
    system_prompt: str | None = _f(None, "System message prepended to text prompts (turns them into chats).")
    max_train_samples: int | None = _f(None, "Use only the first N prompts.")
    eval_dataset: str | None = _f(None, "Eval prompts (same forms as dataset); null = eval_split of dataset, or "
                                  "eval_fraction held out of it, or no evaluation.")
    eval_split: str | None = _f(None, "Split of the eval dataset (or of dataset when eval_dataset is null), e.g. 'test'.")
    eval_fraction: float | None = _f(None, "Hold out this fraction of the training prompts (seeded shuffle) for evaluation.")
    max_eval_samples: int | None = _f(None, "Use only the first N eval prompts.")
    reward_funcs: list[Any] = _f(["accuracy"], "Reward functions: built-in names, module:function, file.py:function, model paths.")
    tools: list[Any] = _f([], "Tools the model may call (multi-turn rollouts): module:function, file.py:function, python, "
                          "or {name: python, timeout: 5, ...}.")
    environment: Any = _f(None, "Environment class per rollout (TRL environment_factory): module:Class, file.py:Class, "
                               "or {name: spec} selected by an `environment` column.")

    def __post_init__(self) -> None:
        _positive(self, "lora_r", "lora_alpha", "max_train_samples", "max_eval_samples")
        if self.eval_fraction is not None and not 0 < self.eval_fraction < 1:
            raise ConfigError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.eval_fraction is not None and (self.eval_dataset is not None or self.eval_split is not None):
            raise ConfigError("eval_fraction holds out training prompts; it cannot be combined with eval_dataset or "
                              "eval_split — choose one source of eval prompts")
        if not self.reward_funcs and self.environment is None:
            raise ConfigError("reward_funcs is empty: give at least one reward function (or an environment with get_reward)")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--key", "value", "--flag=1"]`` into a dict, values parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"override {arg!r} is not of the form --key value")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            raw = args[i + 1]
            i += 1
        else:
            raw = "true"
        out[key.replace("-", "_")] = yaml.safe_load(raw) if raw != "" else ""
        i += 1
    return out


def load_recipe(path: str | Path | None, overrides: dict[str, Any] | None = None) -> tuple[RecipeConfig, BaseRLConfig]:
    """Read a flat YAML recipe (+ overrides) into a RecipeConfig and a GRPOConfig or PPOConfig."""
    values: dict[str, Any] = {}
    source = "overrides"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {str(p)!r}")
        source = str(p)
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}".splitlines()[0]) from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of settings at the top level, got {type(loaded).__name__}")
        values.update(loaded)
    values.update(overrides or {})
    algorithm = values.get("algorithm", "grpo")
    trainer_cls: type[BaseRLConfig] = {"grpo": GRPOConfig, "ppo": PPOConfig}.get(algorithm)  # type: ignore[assignment]
    if trainer_cls is None:
        raise ConfigError(f"{source}: algorithm must be 'grpo' or 'ppo', got {algorithm!r}")
    recipe_keys = set(RecipeConfig.field_names())
    trainer_keys = set(trainer_cls.field_names())
    unknown = [k for k in values if k not in recipe_keys | trainer_keys]
    if unknown:
        raise _unknown_key(source, unknown[0], recipe_keys | trainer_keys)
    recipe = RecipeConfig.from_dict({k: v for k, v in values.items() if k in recipe_keys}, source)
    trainer = trainer_cls.from_dict({k: v for k, v in values.items() if k in trainer_keys}, source)
    return recipe, trainer
