"""Config validation: each bad value gives one clear line; YAML + CLI overrides; TRL names."""

from __future__ import annotations

import pytest

from grpo_ascend.config.configs import GRPOConfig, PPOConfig
from grpo_ascend.config.recipe import RecipeConfig, load_recipe, parse_overrides
from grpo_ascend.errors import ConfigError


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"num_generation": 4}, "unknown key 'num_generation' (did you mean 'num_generations'?)"),
        ({"learning_rate": "fast"}, "learning_rate: expected a number, got 'fast'"),
        ({"num_generations": "8"}, "num_generations: expected an integer"),
        ({"bf16": "yes"}, "bf16: expected true or false"),
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"per_device_train_batch_size": 6}, "must be divisible by num_generations (8)"),
        ({"max_completion_length": 0}, "max_completion_length must be > 0"),
        ({"max_steps": 0}, "max_steps must be a positive number"),
        ({"epsilon_high": 0.1}, "epsilon_high (0.1) must be >= epsilon (0.2)"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"scale_rewards": "grop"}, "did you mean 'group'"),
        ({"importance_sampling_level": "seq"}, "expected one of ['token', 'sequence']"),
        ({"delta": 1.1}, "delta (1.1) must be > 1 + epsilon_high"),
        ({"bf16": True, "fp16": True}, "choose one precision"),
    ],
)
def test_bad_values_give_one_clear_line(values, message):
    with pytest.raises(ConfigError) as info:
        GRPOConfig.from_dict(values)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_trl_field_names_and_booleans():
    cfg = GRPOConfig(scale_rewards=False, num_generations=4, per_device_train_batch_size=4, beta=0.04,
                     epsilon_high=0.28, loss_type="dr_grpo", mask_truncated_completions=True)
    assert cfg.scale_rewards == "none"
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(resume_from_checkpoint=True).resume_from_checkpoint == "latest"


def test_batch_plan_arithmetic():
    cfg = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
                     num_generations=8, num_iterations=2)
    plan = cfg.batch_plan(world_size=2)
    assert plan.completions_per_generation == 32
    assert plan.prompts_per_generation == 4
    assert plan.completions_per_step == 16
    assert plan.optimizer_steps_per_generation == 4
    assert "4 prompts × 8 generations" in plan.describe()
    assert GRPOConfig(generation_batch_size=32, per_device_train_batch_size=8).batch_plan().steps_per_generation == 4


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: builtin:tiny\nnum_generations: 4\nper_device_train_batch_size: 8\nlearning_rate: 1e-5\n"
                    "reward_funcs: [accuracy, format]\n")
    recipe, cfg = load_recipe(path, parse_overrides(["--max_steps", "3", "--beta=0.1", "--bf16"]))
    assert isinstance(recipe, RecipeConfig) and isinstance(cfg, GRPOConfig)
    assert recipe.model == "builtin:tiny" and recipe.reward_funcs == ["accuracy", "format"]
    assert (cfg.num_generations, cfg.learning_rate, cfg.max_steps, cfg.beta, cfg.bf16) == (4, 1e-5, 3, 0.1, True)
    recipe, cfg = load_recipe(None, {"algorithm": "ppo", "kl_coef": 0.1})
    assert isinstance(cfg, PPOConfig) and cfg.kl_coef == 0.1


def test_recipe_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_recipe(tmp_path / "missing.yaml")
    path = tmp_path / "r.yaml"
    path.write_text("modle: x\n")
    with pytest.raises(ConfigError, match="unknown key 'modle' \\(did you mean 'model'\\?\\)"):
        load_recipe(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_recipe(path)
    with pytest.raises(ConfigError, match="not of the form --key value"):
        parse_overrides(["max_steps", "3"])
    with pytest.raises(ConfigError, match="algorithm must be"):
        load_recipe(None, {"algorithm": "dpo"})


def test_ppo_validation():
    with pytest.raises(ConfigError, match="gamma and lam"):
        PPOConfig(lam=1.5)
    with pytest.raises(ConfigError, match="critic_model"):
        PPOConfig(critic_init="reward_model")


def test_recipe_names_still_import_from_config():
    """``from grpo_ascend.config import GRPOConfig, RecipeConfig, ...`` keeps working: the package re-exports the
    config classes and the recipe layer from the modules that define them."""
    import grpo_ascend
    import grpo_ascend.config as config
    from grpo_ascend.config import configs, recipe

    for name in ("GRPOConfig", "PPOConfig", "BatchPlan", "BaseRLConfig"):
        assert getattr(config, name) is getattr(configs, name)
    for name in ("RecipeConfig", "load_recipe", "parse_overrides"):
        assert getattr(config, name) is getattr(recipe, name)
    assert grpo_ascend.RecipeConfig is recipe.RecipeConfig
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        config.nope  # noqa: B018


@pytest.mark.parametrize("spg, accum, iterations, rounds, steps, old", [
    (4, 2, 1, 1, 2, [True]),          # aligned: one generation batch per round, as always
    (2, 2, 1, 1, 1, [False]),         # one step per batch: on-policy, no old log-probs
    (3, 2, 1, 2, 3, [True, True]),    # TRL allows it: the second step straddles the two batches
    (1, 2, 1, 2, 1, [False, False]),  # both batches feed one step, made before it: no step in between
    (1, 3, 2, 3, 2, [False, True, False]),  # the third batch is made after step 1 and used only in step 2
])
def test_batch_plan_when_steps_straddle_generation_batches(spg, accum, iterations, rounds, steps, old):
    """Old log-probs for a batch trained on after an optimizer step that followed its generation (TRL computes
    them whenever gradient_accumulation_steps % (steps_per_generation × μ) != 0; where we skip them they equal
    the current ones)."""
    cfg = GRPOConfig(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=accum,
                     steps_per_generation=spg, num_iterations=iterations)
    plan = cfg.batch_plan()
    assert (plan.generations_per_round, plan.optimizer_steps_per_round) == (rounds, steps)
    assert [plan.old_logps_needed(g) for g in range(rounds)] == old
    assert ("straddle" in plan.describe()) == (rounds > 1)
