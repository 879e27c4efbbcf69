"""Evaluation of tool-calling and rollout_func runs: evaluate() runs the training rollout path (tools,
per-rollout environments, a user's rollout_func) and never perturbs training: not its sampling
stream, not the global RNGs a tool or rollout_func draws from, not its environments' own state."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from helpers import SMALL_RUN
from multiturn_scripts import PROMPT, scripted_add_model, token_ids

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.errors import DataError
from grpo_ascend.models.policy import default_lora_config


class LuckyEnv:
    """An environment with a random stream of its own, drawn at every reset and scored by get_reward;
    its add tool answers with a ticket from Python's global RNG (the model then reads it)."""

    def __init__(self):
        self.rng = random.Random(0)

    def reset(self, **row):
        self.sums = []
        self.luck = self.rng.random()

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first term.
            b: The second term.
        """
        self.sums.append(a + b)
        return f"{a + b} ticket {random.randint(0, 9)}"

    def get_reward(self) -> float:
        return 0.5 * float(self.sums == [5]) + 0.5 * self.luck


def _length_mod_3(prompts, completions, **kwargs):
    return [float(len(c[-1]["content"]) % 3 == 0) for c in completions]


def _trainable(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}


def _train_records(trainer):
    drop = ("time/", "memory/", "tokens_per_second", "tools/time_s", "step_time")  # step_time: TRL's time/step
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in trainer.state.log_history
            if "loss" in r]


EVALUATED = dict(eval_strategy="steps", eval_steps=1, eval_on_start=True, num_generations_eval=2,
                 per_device_eval_batch_size=4)


def test_tool_run_evaluates_through_its_environments_and_trains_as_without(tmp_path, tiny_model_dir):
    """A model that calls add(2, 3), then answers freely after reading the ticket; 2 eval prompts:
    evaluation counts one call per completion and scores the environments, and the run trains
    exactly like the run without evaluation (weights, records and its environments' streams)."""
    runs, python_rng = {}, {}
    for name, extra in (("plain", {}), ("evaluated", {**EVALUATED, "eval_steps": 2})):
        model, tok, call, suffix, _ = scripted_add_model(tiny_model_dir)
        model.script = dict(list(model.script.items())[: len(call)])  # the answer after the tool is sampled
        # One tool step: a <tool_call> the answer may sample (p ≈ 0.002 a token) is never run, so one call
        # per completion, no failed call and the right sum hold whatever was sampled.
        cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / name), "max_prompt_length": 1024,
                            "max_completion_length": len(call) + len(suffix) + 12, "per_device_train_batch_size": 4,
                            "max_tool_calling_iterations": 1, **extra})
        trainer = GRPOTrainer(model, _length_mod_3, cfg, Dataset.from_list([{"prompt": PROMPT}] * 8),
                              eval_dataset=Dataset.from_list([{"prompt": PROMPT}] * 2) if extra else None,
                              processing_class=tok, peft_config=default_lora_config(r=4), environment_factory=LuckyEnv)
        random.seed(123)
        trainer.train()
        runs[name] = trainer
        python_rng[name] = random.getstate()  # the tools' tickets drew from it in training only
        if extra:
            metrics = trainer.evaluate()  # after training too
    plain, evaluated = runs["plain"], runs["evaluated"]
    for n, p in _trainable(plain).items():
        assert torch.equal(p, _trainable(evaluated)[n]), n
    assert _train_records(plain) == _train_records(evaluated) and len(_train_records(plain)) == 2
    # The training rollouts' environments were reset exactly as often; Python's RNG is where training left it.
    streams = [[e.rng.getstate() for e in t.rollout.pool.instances()] for t in (plain, evaluated)]
    assert len(streams[0]) == 4 and streams[0] == streams[1]
    assert evaluated.evaluator.rollout.pool is not evaluated.rollout.pool
    assert python_rng["plain"] == python_rng["evaluated"]

    evaluations = [r for r in evaluated.state.log_history if "eval/reward" in r]
    assert [r["step"] for r in evaluations] == [0, 2, 2]
    assert metrics["eval/num_prompts"] == 2 and metrics["eval/num_generations"] == 2
    assert metrics["eval/tools/calls_per_completion"] == 1.0 and metrics["eval/tools/failed_calls"] == 0
    assert metrics["eval/tools/turns_per_completion"] == 2.0
    luck = metrics["eval/rewards/LuckyEnv/mean"]  # 0.5 for the right sum + half a uniform draw
    assert 0.5 < luck < 1.0 and 0.5 < metrics["eval/greedy/rewards/LuckyEnv/mean"] < 1.0
    assert metrics["eval/reward"] == pytest.approx(luck + metrics["eval/rewards/_length_mod_3/mean"])


def test_rollout_func_run_evaluates_with_the_calls_sampling_and_trains_as_without(tmp_path, tiny_model_dir):
    """A rollout_func drawing its completions from torch's global RNG: evaluation calls it with
    trainer.rollout_params (2 sampled completions per prompt, then 1 greedy at temperature 0) and the
    run trains exactly like the run without evaluation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def rollout_func(prompts, trainer):
        params = trainer.rollout_params
        calls.append((len(prompts), params.num_generations, params.temperature))
        prompt_ids = [token_ids(tok, p) for p in prompts for _ in range(params.num_generations)]
        completions = [torch.randint(5, 400, (int(torch.randint(1, 6, ())),)).tolist() + [tok.eos_token_id]
                       for _ in prompt_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": completions,
                "logprobs": [[-1.0] * len(c) for c in completions]}

    def even_share(completion_ids, **kwargs):
        return [sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids]

    runs = {}
    for name, extra in (("plain", {}), ("evaluated", {**EVALUATED, "eval_temperature": 0.7})):
        calls = []
        cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / name), **extra})
        dataset = Dataset.from_list([{"prompt": t} for t in ("alpha", "beta", "gamma", "delta")])
        trainer = GRPOTrainer(str(tiny_model_dir), even_share, cfg, dataset, peft_config=default_lora_config(r=4),
                              eval_dataset=Dataset.from_list([{"prompt": "epsilon"}, {"prompt": "zeta"}, {"prompt": "eta"}])
                              if extra else None, rollout_func=rollout_func)
        trainer.train()
        runs[name] = (trainer, calls)
    (plain, plain_calls), (evaluated, evaluated_calls) = runs["plain"], runs["evaluated"]
    for n, p in _trainable(plain).items():
        assert torch.equal(p, _trainable(evaluated)[n]), n
    assert _train_records(plain) == _train_records(evaluated)
    training = (2, 4, 1.0)  # the round's 2 prompts per rank × num_generations 4, the run's temperature
    assert plain_calls == [training] * 2
    one_eval = [(2, 2, 0.7), (2, 1, 0.0), (1, 2, 0.7), (1, 1, 0.0)]  # chunks of 2 prompts, sampled then greedy
    assert evaluated_calls == one_eval + [training] + one_eval + [training] + one_eval
    assert [r["eval/num_prompts"] for r in evaluated.state.log_history if "eval/reward" in r] == [3.0] * 3

    # A rollout_func that ignores rollout_params gets the count error naming it.
    evaluated.rollout.rollout_func = lambda prompts, trainer: rollout_func(
        prompts, SimpleNamespace(rollout_params=trainer.rollout.params))
    with pytest.raises(DataError, match="rollout_params.num_generations"):
        evaluated.evaluate()
