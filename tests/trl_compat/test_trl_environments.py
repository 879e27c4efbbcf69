"""Environments that own their data, as TRL 1.16: no ``train_dataset`` (with ``max_steps``), rows without a
prompt routed to one of several environments by their ``environment`` column, environment-owned rewards
beside reward functions, TRL's errors where a run cannot do without a dataset; eval tools/call_frequency."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from helpers import SMALL_RUN, capture_scored
from multiturn_scripts import AddEnv
from transformers import AutoTokenizer

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.prompts import EMPTY_PROMPT
from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.eval_metrics import finish_eval_metrics
from grpo_ascend.tools.environment_data import MAX_STEPS_NEEDED, SEVERAL_ENVIRONMENTS_NEED_DATA

QUESTION = " What is two plus three?"


class Adder(AddEnv):
    """Owns its data: reset() returns the question; get_reward() reads the rollout's state."""

    resets: list[dict] = []

    def reset(self, **row):
        Adder.resets.append(row)
        self.sums = []
        return QUESTION

    def get_reward(self) -> float:
        return 0.25


class Speller:
    """A second environment with a tool of its own."""

    resets: list[dict] = []

    def reset(self, **row):
        Speller.resets.append(row)
        return " Spell 'cat'."

    def spell(self, word: str) -> str:
        """Spell a word.

        Args:
            word: The word to spell.
        """
        return "-".join(word)

    def get_reward(self) -> float:
        return 0.75


def _config(tmp_path, **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": 1, "max_prompt_length": 1024,
                         "max_completion_length": 12, "max_tool_calling_iterations": 1, **kw})


def _prompt_texts(exp, tok):
    return tok.batch_decode([ids[mask.bool()] for ids, mask in zip(exp.prompt_ids, exp.prompt_mask)])


def test_environment_supplies_the_prompts_without_a_train_dataset(tmp_path, tiny_model_dir):
    """train_dataset left out: a placeholder of empty user messages (one generation round's prompts), each
    rollout's reset() (which, as in TRL, receives the placeholder prompt) adds the question; get_reward is
    the only reward."""
    Adder.resets.clear()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(str(tiny_model_dir), None, _config(tmp_path), environment_factory=Adder)
    assert len(trainer.train_dataset) == 2  # 8 completions per round / 4 generations
    assert trainer.train_dataset[0]["prompt"] == EMPTY_PROMPT
    seen = capture_scored(trainer)
    trainer.train()
    exp = seen[0]
    assert Adder.resets[-8:] == [{"prompt": EMPTY_PROMPT}] * 8
    assert all(text.count(QUESTION) == 1 for text in _prompt_texts(exp, tok))
    assert exp.prompts == [EMPTY_PROMPT] * 8
    assert exp.reward_names == ["Adder"] and exp.rewards.tolist() == [0.25] * 8
    assert trainer.state.log_history[0]["rewards/Adder/mean"] == 0.25


def test_routing_rows_without_prompt_pick_their_environment_beside_reward_functions(tmp_path, tiny_model_dir):
    """A dataset with only an ``environment`` column: each row starts from an empty user message, its
    environment (only its tools in the prompt) gets reset() without the routing column, and each
    environment's get_reward scores its own rollouts next to a plain reward function (None for the others)."""
    Adder.resets.clear()
    Speller.resets.clear()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen_by_function = []

    def length(prompts, completions, environments, **kwargs):
        seen_by_function.append((prompts, [type(e) for e in environments]))
        return [1.0] * len(completions)

    dataset = Dataset.from_list([{"environment": "adder"}, {"environment": "speller"}])
    trainer = GRPOTrainer(str(tiny_model_dir), [length], _config(tmp_path, shuffle_dataset=False), dataset,
                          environment_factory={"adder": Adder, "speller": Speller},
                          eval_dataset=Dataset.from_list([{"environment": "speller"}] * 2))
    seen = capture_scored(trainer)
    trainer.train()
    exp = seen[0]
    assert Adder.resets[-4:] == [{}] * 4 and Speller.resets[-4:] == [{}] * 4
    texts = _prompt_texts(exp, tok)
    assert all(QUESTION in t and '"add"' in t and '"spell"' not in t for t in texts[:4])
    assert all("Spell 'cat'." in t and '"spell"' in t and '"add"' not in t for t in texts[4:])
    prompts, types = seen_by_function[0]
    assert prompts == [EMPTY_PROMPT] * 8 and types == [Adder] * 4 + [Speller] * 4
    assert exp.reward_names == ["length", "Adder", "Speller"]
    per_function = exp.rewards_per_function.tolist()
    assert all(row[0] == 1.0 and row[1] == 0.25 and math.isnan(row[2]) for row in per_function[:4])
    assert all(row[0] == 1.0 and math.isnan(row[1]) and row[2] == 0.75 for row in per_function[4:])
    assert exp.rewards.tolist() == [1.25] * 4 + [1.75] * 4
    metrics = trainer.evaluate()  # an eval set without prompts too
    assert metrics["eval/rewards/Speller/mean"] == 0.75 and metrics["eval/reward"] == 1.75
    assert "eval_loss" in metrics


def test_runs_that_need_a_train_dataset_say_so(tmp_path, tiny_model_dir):
    """TRL's errors: several environments need a dataset to route rows; without one max_steps must be set;
    without any environment the dataset is required (ConfigError is a ValueError, as TRL raises)."""
    with pytest.raises(ConfigError) as several:
        GRPOTrainer(str(tiny_model_dir), None, _config(tmp_path), environment_factory={"a": Adder, "b": Speller})
    assert str(several.value) == SEVERAL_ENVIRONMENTS_NEED_DATA
    with pytest.raises(ConfigError) as steps:
        GRPOTrainer(str(tiny_model_dir), None, _config(tmp_path, max_steps=-1), environment_factory=Adder)
    assert str(steps.value) == f"{MAX_STEPS_NEEDED} (got max_steps=-1)"
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(str(tiny_model_dir), lambda completions, **k: [0.0] * len(completions), _config(tmp_path))
    with pytest.raises(DataError, match="no prompt column 'prompt'"):  # only environments may leave prompts out
        GRPOTrainer(str(tiny_model_dir), lambda completions, **k: [0.0] * len(completions), _config(tmp_path),
                    Dataset.from_list([{"question": "x"}]))


def test_eval_tool_metrics_carry_trls_call_frequency():
    """Evaluation of a tool run: tools/call_frequency (calls per completion) and tools/failure_frequency
    (failed calls per call), TRL's names, from the sampled pass's sums."""
    sums = {"prompts": 2.0, "greedy/pass_sum": 0.0, "sampled/tools/calls": 6.0, "sampled/tools/turns": 10.0,
            "sampled/tools/failed_calls": 3.0, "sampled/tools/completions": 8.0}
    for mode in ("sampled/", "greedy/"):
        sums.update({f"{mode}rows": 8.0, f"{mode}reward_sum": 0.0, f"{mode}reward_sq_sum": 0.0,
                     f"{mode}length_sum": 8.0})
    metrics = finish_eval_metrics(sums, [], 4)
    assert metrics["tools/call_frequency"] == 0.75 and metrics["tools/calls_per_completion"] == 0.75
    assert metrics["tools/failure_frequency"] == 0.5


def test_trainer_names_its_reward_sources_weights_and_tools_as_trl(tmp_path, tiny_model_dir):
    """An environment's get_reward comes after the reward functions, named after its class with weight 1; the
    tools are the standalone ones, then every environment's methods (never reset / get_reward)."""

    def format_reward(completions, **kwargs):
        return [0.0] * len(completions)

    def shout(text: str) -> str:
        """Shout a text.

        Args:
            text: The text to shout.
        """
        return text.upper()

    trainer = GRPOTrainer(str(tiny_model_dir), [format_reward], _config(tmp_path, reward_weights=[0.5]),
                          Dataset.from_list([{"environment": "adder"}, {"environment": "speller"}]), tools=[shout],
                          environment_factory={"adder": Adder, "speller": Speller})
    assert trainer.reward_func_names == ["format_reward", "Adder", "Speller"]
    assert trainer.reward_weights.dtype == torch.float32 and trainer.reward_weights.tolist() == [0.5, 1.0, 1.0]
    assert [getattr(f, "__name__", None) for f in trainer.reward_funcs] == ["format_reward", "Adder", "Speller"]
    assert [t.__name__ for t in trainer.tools] == ["shout", "add", "spell"]
