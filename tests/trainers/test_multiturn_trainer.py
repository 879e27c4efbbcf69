"""GRPOTrainer's tool surface (TRL 1.16 names): tools=, environment_factory= (with get_reward as an
extra reward) and rollout_func=; tool tokens stay in the context and out of the loss mask."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from helpers import SMALL_RUN, capture_scored, preempt_and_resume
from multiturn_scripts import PROMPT, AddEnv, ScriptedQwen2, add, scripted_add_model, token_ids
from transformers import AutoTokenizer

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.errors import ConfigError


@pytest.mark.parametrize(("surface", "mode"), [("tools", "sync"), ("environment", "sync"), ("environment", "async")])
def test_trainer_runs_tool_conversations_and_masks_tool_tokens(tmp_path, tiny_model_dir, surface, mode):
    """The tool loop in a run; asynchronous: on the producer's side, over the rollout process's sessions."""
    model, tok, call, suffix, seq = scripted_add_model(tiny_model_dir)
    calls = []

    def reward(prompts, completions, **kwargs):
        calls.append((completions, kwargs))
        return [float(c[-1]["content"] == "five") for c in completions]

    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": 1, "max_prompt_length": 1024,
                        "max_completion_length": 80, "per_device_train_batch_size": 4, "max_tool_calling_iterations": 2,
                        "rollout_mode": mode})
    extra = {"tools": [add]} if surface == "tools" else {"environment_factory": AddEnv}
    trainer = GRPOTrainer(model, reward, cfg, Dataset.from_list([{"prompt": PROMPT}] * 4), processing_class=tok,
                          **extra)
    seen = capture_scored(trainer)
    trainer.train()
    exp = seen[0]
    n = len(seq)
    assert exp.completion_ids[:, :n].tolist() == [seq] * exp.size
    assert exp.completion_mask.sum(1).tolist() == [n] * exp.size
    expected_loss = [1.0] * len(call) + [0.0] * len(suffix) + [1.0] * (n - len(call) - len(suffix))
    assert exp.loss_mask[:, :n].tolist() == [expected_loss] * exp.size
    completions, kwargs = calls[0]
    assert completions[0][1] == {"role": "tool", "name": "add", "content": "5"}
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["tools/calls_per_completion"] == 1.0 and record["tools/turns_per_completion"] == 2.0
    assert record["tools/call_frequency"] == 1.0 and record["tools/failure_frequency"] == 0.0
    assert record["tools/calls"] == exp.size and record["tools/failed/timeout"] == 0.0
    assert record["rewards/reward/mean"] == 1.0
    if surface == "environment":
        assert all(isinstance(e, AddEnv) for e in kwargs["environments"])
        assert record["rewards/AddEnv/mean"] == 1.0


def test_rollout_func_contract(tmp_path, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    got = {}

    def rollout_func(prompts, trainer):
        got["prompts"] = prompts
        G = trainer.args.num_generations
        prompt_ids = [token_ids(tok, p) for p in prompts for _ in range(G)]
        completion = token_ids(tok, "one two") + [tok.eos_token_id]
        return {"prompt_ids": prompt_ids, "completion_ids": [completion] * len(prompt_ids),
                "logprobs": [[-0.5] * len(completion)] * len(prompt_ids),
                "env_mask": [[1, 0] + [1] * (len(completion) - 2)] * len(prompt_ids),
                "source": ["custom"] * len(prompt_ids), "round_tag": 7}

    def reward(prompts, completions, source, round_tag, **kwargs):
        assert set(source) == {"custom"} and set(round_tag) == {7}
        return [1.0 if i % 2 else 0.0 for i in range(len(completions))]

    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": 1})
    dataset = Dataset.from_list([{"prompt": "alpha"}, {"prompt": "beta"}])
    trainer = GRPOTrainer(str(tiny_model_dir), reward, cfg, dataset, rollout_func=rollout_func)
    seen = capture_scored(trainer)
    trainer.train()
    exp = seen[0]
    assert sorted(got["prompts"]) == ["alpha", "beta"]
    assert exp.loss_mask[:, :2].tolist() == [[1.0, 0.0]] * exp.size
    assert (exp.sampling_logps[exp.completion_mask.bool()] == -0.5).all()
    assert not trainer.experience.exact_sampling_logps  # old log-probs come from the trainer's forward


def test_tool_surface_errors(tiny_model_dir):
    cfg = GRPOConfig(**SMALL_RUN)
    with pytest.raises(ConfigError, match="either rollout_func or tools"):
        GRPOTrainer(str(tiny_model_dir), lambda **k: [0.0], cfg, Dataset.from_list([{"prompt": "a"}]),
                    tools=[add], rollout_func=lambda p, t: {})
    with pytest.raises(ConfigError, match="tool_call_parser 'qwne' is unknown.*qwen"):
        GRPOConfig(tool_call_parser="qwne")
    with pytest.raises(ConfigError, match="max_tool_calling_iterations"):
        GRPOConfig(max_tool_calling_iterations=-1)


def test_recipe_tools_and_environment_keys(tmp_path, tiny_model_dir):
    from grpo_ascend.config.recipe import RecipeConfig
    from grpo_ascend.rollout.row_rollouts import ToolRollout
    from grpo_ascend.run import build_trainer

    args = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run")})
    recipe = RecipeConfig(model=str(tiny_model_dir), tools=["python", "tests/support/multiturn_scripts.py:add"],
                          dataset_kwargs={"n": 4})
    trainer = build_trainer(recipe, args)
    assert isinstance(trainer.rollout, ToolRollout) and trainer.rollout.pool is None
    assert trainer.rollout.multiturn.tools.toolset.names == ["python", "add"]
    recipe = RecipeConfig(model=str(tiny_model_dir), environment="multiturn_scripts:AddEnv", reward_funcs=[],
                          dataset_kwargs={"n": 4})
    trainer = build_trainer(recipe, args)
    assert isinstance(trainer.rollout, ToolRollout) and trainer.rollout.pool is not None
    assert trainer.rewards.names == ["AddEnv"]
    with pytest.raises(ConfigError, match="grpo only"):
        build_trainer(RecipeConfig(model=str(tiny_model_dir), algorithm="ppo", tools=["python"]),
                      GRPOConfig(**SMALL_RUN))


class NumberedEnv:
    """reset's observation differs per rollout, so a group's rows cannot share one prompt."""

    made = 0

    def reset(self, **row):
        NumberedEnv.made += 1
        return f" Rollout {NumberedEnv.made}."

    def noop(self) -> str:
        """Do nothing."""
        return ""


def test_rollout_observations_that_differ_within_a_group_get_their_own_prompts(tiny_model_dir):
    from grpo_ascend.rollout.engine import RolloutEngine
    from grpo_ascend.rollout.row_rollouts import build_tool_rollout, prepare_tools
    from grpo_ascend.rollout.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = ScriptedQwen2.from_pretrained(tiny_model_dir).eval()
    model.script = {}
    engine = RolloutEngine(model, tok, SamplingParams(num_generations=3, max_completion_length=4, max_prompt_length=1024,
                                                      seed=0))
    toolset, pool = prepare_tools(None, NumberedEnv)
    rollout = build_tool_rollout(engine, tok, GRPOConfig(), toolset, pool)
    NumberedEnv.made = 0
    batch = rollout.generate_rows([{"prompt": PROMPT}, {"prompt": [{"role": "user", "content": "other"}]}])
    assert len(batch) == 6 and batch.num_generations == 3 and batch.num_prompts == 2
    for k, text in enumerate(batch.prompt_texts):
        assert f"Rollout {k + 1}." in text and ("add two and three" in text) == (k < 3)
    assert [type(e) for e in batch.extra_columns["environments"]] == [NumberedEnv] * 6


def test_resume_with_tools_and_environments_is_exact(tmp_path, tiny_model_dir):
    from grpo_ascend.models.policy import default_lora_config

    def reward(prompts, completions, **kwargs):
        return [float(len(c[-1]["content"]) % 3 == 0) for c in completions]

    def make(out):
        model, tok, call, suffix, seq = scripted_add_model(tiny_model_dir)
        # Only the call is forced; the answer after the tool response is sampled. One tool step: a
        # <tool_call> the answer may sample (p ≈ 0.002 a token) is never run, so one call per completion
        # holds whatever was sampled.
        model.script = dict(list(model.script.items())[: len(call)])
        cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(out), "max_steps": 4, "save_steps": 2, "beta": 0.02,
                            "max_prompt_length": 1024, "max_completion_length": len(call) + len(suffix) + 8,
                            "per_device_train_batch_size": 8, "steps_per_generation": 1,
                            "max_tool_calling_iterations": 1})
        return GRPOTrainer(model, reward, cfg, Dataset.from_list([{"prompt": PROMPT}] * 4), processing_class=tok,
                           peft_config=default_lora_config(r=4), environment_factory=AddEnv)

    _, killed, _ = preempt_and_resume(lambda name: make(tmp_path / name), step=2)
    assert killed.step == 2

    def stable(path):
        skip = ("time/", "tokens_per_second", "memory/", "tools/time_s")
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(skip)} for line in open(path)]

    full_log, resumed_log = stable(tmp_path / "full" / "metrics.jsonl"), stable(tmp_path / "resumed" / "metrics.jsonl")
    assert full_log == resumed_log and len(full_log) == 4
    assert all(r["tools/calls_per_completion"] == 1.0 and r["rewards/AddEnv/mean"] == 1.0 for r in full_log)


@pytest.mark.parametrize("outcome", ["finished", "failed"])
def test_tool_executor_is_closed_when_training_ends(tmp_path, tiny_model_dir, outcome):
    """No idle tool threads are left after train(), whether it finished or raised."""
    model, tok, *_ = scripted_add_model(tiny_model_dir)

    def reward(prompts, completions, **kwargs):
        if outcome == "failed":
            raise RuntimeError("reward server down")
        return [1.0] * len(completions)

    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "max_steps": 1, "max_prompt_length": 1024,
                        "max_completion_length": 80, "per_device_train_batch_size": 4})
    trainer = GRPOTrainer(model, reward, cfg, Dataset.from_list([{"prompt": PROMPT}] * 4), processing_class=tok,
                          tools=[add])
    executor = trainer.rollout.multiturn.tools.executor
    used = []
    run = executor.run
    executor.run = lambda *a, **kw: used.append(1) or run(*a, **kw)
    if outcome == "failed":
        with pytest.raises(Exception, match="reward server down"):
            trainer.train()
    else:
        trainer.train()
    assert used and not executor.running
