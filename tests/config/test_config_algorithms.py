"""GRPOConfig: KL estimator, CISPO/SAPO settings, importance-sampling correction and TRL's alias names."""

from __future__ import annotations

import pytest

from grpo_ascend.config.configs import GRPOConfig
from grpo_ascend.config.recipe import load_recipe
from grpo_ascend.errors import ConfigError


def test_defaults_keep_todays_loss_and_follow_trl():
    cfg = GRPOConfig()
    assert cfg.kl_estimator == "k3" and cfg.use_bias_correction_kl is True
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) == (1.0, 1.05)
    assert cfg.importance_sampling_correction is False
    assert (cfg.importance_sampling_mode, cfg.importance_sampling_clip_max, cfg.importance_sampling_clip_min) == (
        "sequence_mask", 3.0, None)


def test_rollouts_ahead_correct_per_token_by_default_and_a_setting_wins():
    """Staleness: token_mask (measured in docs/async.md); a sync sampler keeps TRL's sequence_mask."""
    for mode in ("one_step_off", "async"):
        cfg = GRPOConfig(rollout_mode=mode)
        assert (cfg.importance_sampling_correction, cfg.importance_sampling_mode) == (True, "token_mask")
        assert GRPOConfig(**cfg.to_dict()).importance_sampling_mode == "token_mask"
    assert GRPOConfig(rollout_mode="async", importance_sampling_mode="sequence_mask").importance_sampling_mode == (
        "sequence_mask")
    assert GRPOConfig(rollout_mode="async", vllm_importance_sampling_mode="sequence_truncate").importance_sampling_mode \
        == "sequence_truncate"
    assert GRPOConfig(use_vllm=True).importance_sampling_mode == "sequence_mask"


def test_trl_names_are_aliases(tmp_path):
    cfg = GRPOConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
                     vllm_importance_sampling_cap=2.0, vllm_importance_sampling_clip_min=0.5)
    assert cfg.importance_sampling_correction is True
    assert cfg.importance_sampling_mode == "token_truncate"
    assert (cfg.importance_sampling_clip_max, cfg.importance_sampling_clip_min) == (2.0, 0.5)
    assert cfg.vllm_importance_sampling_mode is None and cfg.vllm_importance_sampling_cap is None
    assert GRPOConfig(**cfg.to_dict()) == cfg  # round-trips (checkpoints store to_dict())
    recipe = tmp_path / "r.yaml"
    recipe.write_text("vllm_importance_sampling_mode: token_mask\nvllm_importance_sampling_clip_max: 4\n")
    _, trainer = load_recipe(recipe, {"vllm_importance_sampling_correction": True})
    assert (trainer.importance_sampling_mode, trainer.importance_sampling_clip_max) == ("token_mask", 4.0)
    assert trainer.importance_sampling_correction is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kl_estimator": "k4"}, "kl_estimator must be one of k1, k2, k3, got 'k4'"),
        ({"multi_objective_aggregation": "normalise_then_sum"},
         "unknown multi_objective_aggregation 'normalise_then_sum' \\(did you mean 'normalize_then_sum'\\?\\)"),
        ({"multi_objective_aggregation": "normalize_then_sum", "advantage_estimator": "rloo"},
         "does not combine with advantage_estimator='rloo'"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile must be in \\[0, 1\\]"),
        ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min"),
        ({"sync_ref_model": True}, "sync_ref_model=True with beta=0.0"),
        ({"ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha must be in"),
        ({"loss_type": "vespo", "importance_sampling_correction": True},
         "importance_sampling_mode must be token_truncate or token_mask"),
        ({"sapo_temperature_pos": -1.0}, "sapo_temperature_pos must be > 0, got -1.0"),
        ({"importance_sampling_mode": "token_trunc"},
         "importance_sampling_mode must be one of .*got 'token_trunc' \\(did you mean 'token_truncate'\\?\\)"),
        ({"vllm_importance_sampling_mode": "sequence"}, "importance_sampling_mode must be one of"),
        ({"importance_sampling_clip_min": 3.0}, "clip_min \\(3.0\\) must be less than importance_sampling_clip_max"),
        ({"importance_sampling_clip_max": -2.0}, "importance_sampling_clip_max must be a finite number >= 0"),
        ({"importance_sampling_correction": True, "importance_sampling_mode": "token_truncate",
          "importance_sampling_clip_max": None}, "needs importance_sampling_clip_max or importance_sampling_clip_min"),
        ({"vllm_importance_sampling_cap": 2.0, "importance_sampling_clip_max": 5.0},
         "vllm_importance_sampling_cap=2.0 \\(TRL's name for importance_sampling_clip_max\\) conflicts"),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**kwargs)


def test_cispo_and_sapo_configs_build():
    assert GRPOConfig(loss_type="cispo", epsilon_high=5.0).epsilon_high == 5.0
    assert GRPOConfig(loss_type="sapo", sapo_temperature_neg=2.0).sapo_temperature_neg == 2.0
