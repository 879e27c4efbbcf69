"""Errors and warnings TRL users grep for keep TRL 1.16's wording where the meaning is the same."""

from __future__ import annotations

import inspect
import logging

import pytest

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.errors import ConfigError
from reward_models import RewardSet

MISSING_DATASET = "`train_dataset` is required"
ALL_NONE = ("All reward functions returned None", "Please ensure that at least one reward function returns a valid reward.")


def _length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_missing_train_dataset_says_so_in_trls_words(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError) as ours:
        GRPOTrainer(model=str(tiny_model_dir), reward_funcs=_length, args=GRPOConfig(output_dir=str(tmp_path)))
    assert str(ours.value).startswith(MISSING_DATASET + ": pass a datasets.Dataset with a 'prompt' column")
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl==1.16.0)")
    with pytest.raises(ValueError) as theirs:  # ours is a ConfigError, a ValueError as TRL's
        trl.GRPOTrainer(model=str(tiny_model_dir), reward_funcs=_length,
                        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, report_to="none"))
    assert str(theirs.value).startswith(MISSING_DATASET)


def test_all_rewards_none_warning_carries_trls_sentences(caplog):
    def nothing(completions, **kwargs):
        return [None] * len(completions)

    with caplog.at_level(logging.WARNING, logger="reward_models"):
        out = RewardSet([nothing])(["p", "p"], ["a", "b"], [[1], [2]], {})
    assert out.all_none == 2 and out.total.tolist() == [0.0, 0.0]
    message = next(r.getMessage() for r in caplog.records if ALL_NONE[0] in r.getMessage())
    assert all(sentence in message for sentence in ALL_NONE)
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl==1.16.0)")
    source = inspect.getsource(trl.GRPOTrainer)
    assert all(sentence in source for sentence in ALL_NONE)  # still TRL's words
