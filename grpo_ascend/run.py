"""``grpo-ascend train``: a YAML recipe (+ ``--key value`` overrides) to a finished run."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from typing import Any

from grpo_ascend.config.configs import BaseRLConfig
from grpo_ascend.config.recipe import RecipeConfig, load_recipe, parse_overrides
from grpo_ascend.data.prompts import load_prompt_dataset
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import default_lora_config, load_causal_lm, resolve_model_path
from grpo_ascend.tools import load_environment_factory, load_toolset
from grpo_ascend.trainers.grpo import GRPOTrainer
from grpo_ascend.trainers.ppo import PPOTrainer
from reward_models import load_reward_function

logger = logging.getLogger(__name__)


def build_trainer(recipe: RecipeConfig, args: BaseRLConfig) -> Any:
    """Dataset, rewards, LoRA and the trainer a recipe describes (nothing runs yet)."""
    dataset = load_prompt_dataset(
        recipe.dataset,
        split=recipe.dataset_split,
        config_name=recipe.dataset_config,
        synthetic_kwargs=recipe.dataset_kwargs,
        prompt_column=recipe.prompt_column,
        system_prompt=recipe.system_prompt,
        max_samples=recipe.max_train_samples,
    )
    dataset, eval_dataset = train_and_eval_prompts(recipe, dataset, args.seed)
    peft_config = (
        default_lora_config(recipe.lora_r, recipe.lora_alpha, recipe.lora_dropout, recipe.lora_target_modules)
        if recipe.use_peft
        else None
    )
    reward_funcs = _reward_specs(recipe.reward_funcs, args)
    model = load_causal_lm(recipe.model, recipe.model_dtype)
    model.config._name_or_path = _model_path(recipe.model)
    if recipe.algorithm == "ppo":
        if recipe.tools or recipe.environment is not None:
            raise ConfigError("tools and environment are supported with algorithm: grpo only; remove them or use grpo")

        return PPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                          eval_dataset=eval_dataset, peft_config=peft_config)

    tool_options: dict[str, Any] = {}
    if recipe.tools:

        tool_options["tools"] = load_toolset(recipe.tools)
    if recipe.environment is not None:

        tool_options["environment_factory"] = load_environment_factory(recipe.environment)
    return GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                       eval_dataset=eval_dataset, peft_config=peft_config, **tool_options)


def train_and_eval_prompts(recipe: RecipeConfig, dataset: Any, seed: int) -> tuple[Any, Any]:
    """(train prompts, eval prompts or None) of a recipe whose train prompts are ``dataset``: ``eval_fraction``
    of them held out (split with ``seed``), or the recipe's ``eval_dataset`` / ``eval_split`` loaded."""

    if recipe.eval_fraction is not None:
        n_eval = max(1, round(len(dataset) * recipe.eval_fraction))
        if n_eval >= len(dataset):
            raise ConfigError(f"eval_fraction {recipe.eval_fraction} of {len(dataset)} prompts leaves none to train on")
        parts = dataset.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
        held_out = parts["test"]
        if recipe.max_eval_samples is not None:
            held_out = held_out.select(range(min(recipe.max_eval_samples, len(held_out))))
        return parts["train"], held_out
    if recipe.eval_dataset is None and recipe.eval_split is None:
        return dataset, None
    spec = recipe.eval_dataset if recipe.eval_dataset is not None else recipe.dataset
    eval_ds = load_prompt_dataset(
        spec,
        split=recipe.eval_split or "train",
        config_name=recipe.dataset_config,
        synthetic_kwargs={**recipe.dataset_kwargs, "seed": recipe.dataset_kwargs.get("seed", 0) + 1}
        if spec.startswith("synthetic:") else recipe.dataset_kwargs,
        prompt_column=recipe.prompt_column,
        system_prompt=recipe.system_prompt,
        max_samples=recipe.max_eval_samples,
    )
    return dataset, eval_ds


def _model_path(name: str) -> str:

    return resolve_model_path(name)


def _reward_specs(specs: list[Any], args: BaseRLConfig) -> list[Any]:
    """Reward specs from YAML; built-ins that need the completion limit get it from the config."""
    out = []
    for spec in specs:
        if isinstance(spec, dict) and spec.get("name") == "overlong":
            spec = {"max_completion_length": args.max_completion_length, **spec}
        out.append(load_reward_function(spec))
    return out


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num_processes", "--num-processes", type=int, default=None, metavar="N",
        help="data-parallel processes to start on this machine through `accelerate launch` (one per "
        "device; gloo processes on the CPU). For several machines use `accelerate launch --config_file "
        "recipes/accelerate/<file>.yaml -m grpo_ascend.cli train ...` instead",
    )
    parser.add_argument("config", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--key value pairs overriding the recipe")


def _split_num_processes(tokens: list[str]) -> tuple[int | None, list[str]]:
    """Take ``--num_processes N`` (or ``=N``, or the hyphenated spelling) out of the override tokens."""
    rest: list[str] = []
    found: str | None = None
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, value = token.partition("=")
        if name in ("--num_processes", "--num-processes"):
            if not eq:
                if i + 1 >= len(tokens):
                    raise ConfigError("--num_processes needs a value: the number of processes to start")
                value = tokens[i + 1]
                i += 1
            found = value
        else:
            rest.append(token)
        i += 1
    if found is None:
        return None, rest
    try:
        return int(found), rest
    except ValueError:
        raise ConfigError(f"--num_processes must be an integer, got {found!r}") from None


def _launched_world_size() -> int | None:
    """The process count of the launcher that started this process, or None when none did."""
    if os.environ.get("LOCAL_RANK") is None:
        return None
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_command(config: str, overrides: list[str], num_processes: int, log_level: str | None = None) -> list[str]:
    """The ``accelerate launch`` command running ``grpo-ascend train CONFIG OVERRIDES`` in N local processes.

    accelerate's multi-process launcher (torchrun underneath) sets RANK / LOCAL_RANK / WORLD_SIZE;
    each process then takes its device from LOCAL_RANK and the trainer joins the process group with
    the device's backend (gloo on the CPU). Port 0 lets accelerate pick a free rendezvous port.
    """
    if num_processes < 1:
        raise ConfigError(f"--num_processes must be >= 1, got {num_processes}")
    launched = _launched_world_size()
    if launched is not None:
        raise ConfigError(
            f"--num_processes {num_processes} asks grpo-ascend to start the processes, but this process was "
            f"already started by a launcher with {launched} process(es) (LOCAL_RANK is set); drop "
            "--num_processes and set the process count in the launcher"
        )
    cli = ["-m", "grpo_ascend.cli", *(["--log-level", log_level] if log_level else []), "train", config, *overrides]
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1",
        "--mixed_precision", "no",  # the trainer sets precision itself (bf16 / fp16 in the recipe)
        "--dynamo_backend", "no", "--main_process_port", "0",
        *cli,
    ]


def run_train(ns: argparse.Namespace) -> int:
    """Entry point of ``grpo-ascend train``."""
    num_processes, tokens = _split_num_processes(list(ns.overrides or []))
    if num_processes is None:
        num_processes = ns.num_processes
    elif ns.num_processes is not None and ns.num_processes != num_processes:
        raise ConfigError(f"--num_processes given twice ({ns.num_processes} and {num_processes})")
    launched = _launched_world_size()
    # Start the processes unless this is one of them already (or one process was asked for).
    if num_processes is not None and num_processes != (launched or 1):
        cmd = launch_command(ns.config, tokens, num_processes, getattr(ns, "log_level", None))
        logger.info("starting %d processes: %s", num_processes, " ".join(cmd))
        return subprocess.call(cmd)
    overrides = parse_overrides(tokens)
    recipe, args = load_recipe(ns.config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger("grpo_ascend").setLevel(logging.WARNING)  # one rank reports progress
    trainer = build_trainer(recipe, args)
    trainer.train()
    return 0
