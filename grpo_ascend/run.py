"""``grpo-ascend train``: a YAML recipe (+ ``--key value`` overrides) to a finished run."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from grpo_ascend.config import BaseRLConfig, RecipeConfig, load_recipe, parse_overrides

logger = logging.getLogger(__name__)


def build_trainer(recipe: RecipeConfig, args: BaseRLConfig) -> Any:
    """Dataset, rewards, LoRA and the trainer a recipe describes (nothing runs yet)."""
    from grpo_ascend.data import load_prompt_dataset
    from grpo_ascend.models import default_lora_config, load_causal_lm

    dataset = load_prompt_dataset(
        recipe.dataset,
        split=recipe.dataset_split,
        config_name=recipe.dataset_config,
        synthetic_kwargs=recipe.dataset_kwargs,
        prompt_column=recipe.prompt_column,
        system_prompt=recipe.system_prompt,
        max_samples=recipe.max_train_samples,
    )
    peft_config = (
        default_lora_config(recipe.lora_r, recipe.lora_alpha, recipe.lora_dropout, recipe.lora_target_modules)
        if recipe.use_peft
        else None
    )
    reward_funcs = _reward_specs(recipe.reward_funcs, args)
    model = load_causal_lm(recipe.model, recipe.model_dtype)
    model.config._name_or_path = _model_path(recipe.model)
    if recipe.algorithm == "ppo":
        from grpo_ascend.trainers.ppo import PPOTrainer as Trainer
    else:
        from grpo_ascend.trainers.grpo import GRPOTrainer as Trainer
    return Trainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset, peft_config=peft_config)


def _model_path(name: str) -> str:
    from grpo_ascend.models import resolve_model_path

    return resolve_model_path(name)


def _reward_specs(specs: list[Any], args: BaseRLConfig) -> list[Any]:
    """Reward specs from YAML; built-ins that need the completion limit get it from the config."""
    from reward_models import load_reward_function

    out = []
    for spec in specs:
        if isinstance(spec, dict) and spec.get("name") == "overlong":
            spec = {"max_completion_length": args.max_completion_length, **spec}
        out.append(load_reward_function(spec))
    return out


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value pairs overriding the recipe")


def run_train(ns: argparse.Namespace) -> int:
    """Entry point of ``grpo-ascend train``."""
    overrides = parse_overrides(list(ns.overrides or []))
    recipe, args = load_recipe(ns.config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    trainer = build_trainer(recipe, args)
    trainer.train()
    return 0
