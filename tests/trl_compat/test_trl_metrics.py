"""TRL 1.16's training metrics on ours (issue 37, group 3): policy_loss beside loss with a static and an adaptive
entropy bonus, reward and rewards/<func>/mean with reward weights under both multi_objective_aggregation modes
(completions no function scored left out, with TRL's warning), log_extra columns in the logged completions."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import SMALL_RUN, index_in_group

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.models.policy import default_lora_config

G = 4


def _train(tmp_path, reward_funcs, **kw):
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "num_generations": G, "max_steps": 1, **kw})
    trainer = GRPOTrainer("builtin:tiny", reward_funcs, cfg, arithmetic_dataset(8), peft_config=default_lora_config(r=4))
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return trainer, records


def three(completions, **kwargs):
    return [3.0] * len(completions)


def test_policy_loss_is_the_loss_without_a_static_entropy_bonus(tmp_path):
    trainer, [record] = _train(tmp_path, index_in_group(G), loss_type="bnpo", entropy_coef=0.5)
    # bnpo: the bonus is the step's token-mean entropy, as the logged entropy: loss = policy_loss − coef · H
    assert record["policy_loss"] - record["loss"] == pytest.approx(0.5 * record["entropy"], rel=1e-4)
    entry = trainer.state.log_history[0]
    assert (entry["policy_loss"], entry["loss"], entry["entropy_coef"]) == (record["policy_loss"], record["loss"], 0.5)


def test_policy_loss_with_the_adaptive_bonus(tmp_path):
    trainer, records = _train(tmp_path, index_in_group(G), loss_type="bnpo", max_steps=2, entropy_coef=0.01,
                              use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=0.005)
    first, second = records
    assert first["policy_loss"] == pytest.approx(first["loss"], abs=1e-7)  # step 1: no measurement yet, no bonus
    assert [r["entropy_coef"] for r in records] == pytest.approx([0.015, 0.02])  # after each step's update
    # step 2 applies the coefficient step 1 left
    assert second["policy_loss"] - second["loss"] == pytest.approx(0.015 * second["entropy"], rel=1e-4)
    assert [e["policy_loss"] for e in trainer.state.log_history[:2]] == [first["policy_loss"], second["policy_loss"]]


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_reward_metrics_with_weights_in_both_aggregations(tmp_path, aggregation):
    """TRL: reward = the mean weighted sum of the raw rewards, rewards/<f>/mean each function's raw mean, whatever
    the aggregation of the advantages. index_in_group scores 0..3 in every group whatever was sampled."""
    trainer, [record] = _train(tmp_path, [index_in_group(G), three], reward_weights=[2.0, 0.5],
                               multi_objective_aggregation=aggregation)
    assert record["rewards/index_in_group/mean"] == pytest.approx(1.5)
    assert record["rewards/three/mean"] == pytest.approx(3.0)
    assert record["reward"] == pytest.approx(2.0 * 1.5 + 0.5 * 3.0)
    entry = trainer.state.log_history[0]
    assert (entry["reward"], entry["rewards/three/mean"]) == (record["reward"], record["rewards/three/mean"])


def test_unscored_completions_are_left_out_of_the_reward_with_trls_warning(tmp_path, caplog):
    def index_or_none(completions, **kwargs):
        return [None if i % G == 0 else float(i % G) for i in range(len(completions))]

    def three_or_none(completions, **kwargs):
        return [None if i % G == 0 else 3.0 for i in range(len(completions))]

    with caplog.at_level(logging.WARNING, logger="reward_models"):
        _, [record] = _train(tmp_path, [index_or_none, three_or_none], reward_weights=[2.0, 0.5])
    assert record["rewards/index_or_none/mean"] == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert record["reward"] == pytest.approx(2.0 * 2.0 + 0.5 * 3.0)  # the unscored quarter left out, as TRL
    warned = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("All reward functions returned None for the following kwargs:\n")
    assert "Please ensure that at least one reward function returns a valid reward." in warned[0]


def test_log_extra_columns_reach_the_logged_completions(tmp_path):
    def noted(completions, log_extra, **kwargs):
        log_extra("test_column", [str(c)[:5] for c in completions])
        return [float(len(c)) for c in completions]

    _, [record] = _train(tmp_path, noted, log_completions=True, num_completions_to_print=G)  # TRL's keywords
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == G and all(s["test_column"] == str(s["completion"])[:5] for s in samples)
