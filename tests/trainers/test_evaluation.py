"""Evaluation: pass@k / mean@k against hand computation, evaluate() on a scripted reward, a run with
evaluation trains bit-identically to one without, the best checkpoint pointer, its export, and
load_best_model_at_end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import SMALL_RUN, index_in_group
from safetensors.torch import load_file
from transformers import TrainerCallback

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.cli import main as cli_main
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.errors import ConfigError
from grpo_ascend.eval_metrics import eval_ks, eval_sums, finish_eval_metrics, pass_at_k
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.trainers.evaluating import eval_chunks


def _config(tmp_path, name="run", **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / name), **kw})


def _length_reward(completions, **kwargs):
    """Varies within every group, so every step moves the weights."""
    return [len(c if isinstance(c, str) else c[0]["content"]) / 10 for c in completions]


# ------------------------------------------------------------------------------------- formulas
def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert pass_at_k(5, 2, 4) == 1.0  # fewer than k failures: some draw of 4 always passes
    assert pass_at_k(8, 3, 3) == pytest.approx(1 - math.comb(5, 3) / math.comb(8, 3))
    assert eval_ks(4) == [1, 2, 4] and eval_ks(6) == [1, 2, 4, 6] and eval_ks(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_eval_metrics_by_hand():
    """Two prompts, n = 4, threshold 1: prompt A passes once (first), prompt B twice (2nd and 3rd)."""
    total = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0])
    per_fn = torch.stack([total, torch.tensor([1.0, float("nan"), 0, 0, 0, 0, 0, 0])], 1)
    sampled = {"total": total, "per_function": per_fn, "lengths": torch.tensor([3, 4, 5, 6, 7, 8, 9, 10])}
    greedy = {"total": torch.tensor([1.0, 0.0]), "per_function": torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
              "lengths": torch.tensor([2, 6])}
    m = finish_eval_metrics(eval_sums(sampled, greedy, ["acc", "fmt"], 4, 1.0), ["acc", "fmt"], 4)
    assert m["reward"] == pytest.approx(3.5 / 8)
    assert m["reward_std"] == pytest.approx(float(total.std()))
    assert m["completion_length/mean"] == pytest.approx(52 / 8)
    assert m["rewards/fmt/mean"] == pytest.approx(1 / 7)  # the NaN is left out of the mean
    assert m["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert m["pass@4"] == 1.0
    assert m["mean@1"] == pytest.approx((1 + 0) / 2)
    assert m["mean@2"] == pytest.approx((0.5 + 0.5) / 2)
    assert m["mean@4"] == pytest.approx(m["pass@1"])
    assert m["pass@1/fmt"] == pytest.approx((1 / 4) / 2)  # the NaN row never passes
    assert m["greedy/reward"] == 0.5 and m["greedy/pass"] == 0.5 and m["greedy/completion_length/mean"] == 4.0
    assert m["greedy/rewards/fmt/mean"] == 0.5 and m["num_prompts"] == 2


def test_eval_chunks_are_the_same_on_any_number_of_ranks():
    """Chunks of per_call prompts dealt to the ranks in turn: the same chunks (index and prompts) as
    one process, each on one rank; a rank may hold none."""
    one = eval_chunks(7, 2, 0, 1)
    assert one == [(0, range(0, 2)), (1, range(2, 4)), (2, range(4, 6)), (3, range(6, 7))]
    for world in (2, 3, 8):
        parts = [eval_chunks(7, 2, r, world) for r in range(world)]
        assert sorted(c for part in parts for c in part) == one
    assert eval_chunks(7, 2, 1, 2) == [(1, range(2, 4)), (3, range(6, 7))]
    assert eval_chunks(1, 4, 1, 2) == []


# ------------------------------------------------------------------------------------- trainer
def test_evaluate_on_a_scripted_reward_before_and_after_train(tmp_path):
    """The reward passes the first completion of every group (row index % 4 == 0 in each call):
    c = 1 of n = 4 per prompt; greedy calls hold 2 prompts (per_device_eval_batch_size 8 / 4),
    so one greedy completion in two passes."""

    def first_of_group(completions, **kwargs):
        return [1.0 if i % 4 == 0 else 0.0 for i in range(len(completions))]

    events = []

    class Recorder(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            events.append((state.global_step, metrics["eval/pass@2"]))

    cfg = _config(tmp_path, max_steps=1)
    trainer = GRPOTrainer("builtin:tiny-warm", first_of_group, args=cfg, train_dataset=arithmetic_dataset(8, seed=0),
                          eval_dataset=arithmetic_dataset(6, seed=1), callbacks=[Recorder()])
    for _ in range(2):  # before training, then after it
        m = trainer.evaluate()
        assert m["eval/num_prompts"] == 6 and m["eval/num_generations"] == 4
        assert m["eval/reward"] == pytest.approx(0.25)
        assert m["eval/pass@1"] == pytest.approx(0.25)
        assert m["eval/pass@2"] == pytest.approx(0.5)
        assert m["eval/pass@4"] == 1.0
        assert m["eval/mean@1"] == 1.0 and m["eval/mean@4"] == pytest.approx(0.25)
        assert m["eval/greedy/pass"] == pytest.approx(0.5)
        assert 1 <= m["eval/completion_length/mean"] <= cfg.max_completion_length
        if not events[1:]:
            trainer.train()
    assert events == [(0, 0.5), (1, 0.5)]
    assert trainer.state.log_history[-1]["eval/pass@4"] == 1.0


def _train_records(path):
    drop = ("time/", "memory/", "tokens_per_second")
    return [{k: v for k, v in r.items() if not k.startswith(drop)}
            for r in map(json.loads, open(path)) if "reward" in r]


def test_a_run_with_evaluation_trains_exactly_like_one_without(tmp_path):
    trained = {}
    for name, extra in (("plain", {}), ("evaluated", dict(eval_strategy="steps", eval_steps=1, eval_on_start=True,
                                                             num_generations_eval=3))):
        cfg = _config(tmp_path, name, max_steps=3, **extra)
        trainer = GRPOTrainer("builtin:tiny-warm", _length_reward, args=cfg, train_dataset=arithmetic_dataset(12, seed=0),
                              eval_dataset=arithmetic_dataset(3, seed=1) if extra else None,
                              peft_config=default_lora_config(r=4))
        trainer.train()
        trained[name] = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    for n, p in trained["plain"].items():
        assert torch.equal(p, trained["evaluated"][n]), n
    plain = _train_records(tmp_path / "plain" / "metrics.jsonl")
    evaluated = _train_records(tmp_path / "evaluated" / "metrics.jsonl")
    assert len(plain) == 3 and plain == evaluated
    eval_steps = [r["step"] for r in map(json.loads, open(tmp_path / "evaluated" / "metrics.jsonl")) if "eval/reward" in r]
    assert eval_steps == [0, 1, 2, 3]


def test_best_checkpoint_pointer_export_and_load_best_model_at_end(tmp_path):
    """A step-dependent eval metric peaks at step 2: checkpoint-2 is the best, survives
    save_total_limit=1, is what `export OUTPUT_DIR/best` and `export OUTPUT_DIR --best` write, and
    its weights are the trainer's at the end.

    Step 3 must move the weights, or "the weights are step 2's" proves nothing: the weight decay moves
    every non-zero LoRA weight at every step by construction, whatever was sampled (the index reward
    gives every group non-zero advantages, but the gradients of identical completions would cancel)."""

    def step_bonus(completions, trainer_state=None, **kwargs):
        return [{0: 0.1, 1: 0.2, 2: 0.9, 3: 0.3}[trainer_state["step"]]] * len(completions)

    saved = {}

    class Snapshots(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            saved[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    cfg = _config(tmp_path, max_steps=3, save_steps=1, save_total_limit=1, eval_strategy="steps",
                  metric_for_best_model="eval/rewards/step_bonus/mean", load_best_model_at_end=True,
                  weight_decay=0.1)
    trainer = GRPOTrainer("builtin:tiny-warm", [index_in_group(cfg.num_generations), step_bonus], args=cfg,
                          train_dataset=arithmetic_dataset(12, seed=0), eval_dataset=arithmetic_dataset(2, seed=1),
                          peft_config=default_lora_config(r=4), callbacks=[Snapshots()])
    trainer.train()
    run = tmp_path / "run"
    best = json.loads((run / "best.json").read_text())
    assert best == {"checkpoint": "checkpoint-2", "step": 2, "metric": "eval/rewards/step_bonus/mean",
                    "value": pytest.approx(0.9)}
    assert (run / "best").resolve() == (run / "checkpoint-2").resolve()
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    now = {n: p.detach() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert any(not torch.equal(saved[2][n], saved[3][n]) for n in now)
    for n, p in now.items():
        assert torch.equal(p, saved[2][n]), n
    for args in ([str(run / "best")], [str(run), "--best"]):
        out = tmp_path / f"export{len(args)}"
        assert cli_main(["export", *args, "--out", str(out)]) == 0
        exported = load_file(str(out / "adapter_model.safetensors"))
        expected = {n.replace(".default", ""): p for n, p in saved[2].items()}
        assert set(exported) == set(expected)
        for n, t in exported.items():
            assert torch.equal(t, expected[n]), n


def test_evaluation_settings_are_checked(tmp_path, capsys):
    with pytest.raises(ConfigError, match="multiple of eval_steps"):
        _config(tmp_path, eval_strategy="steps", eval_steps=3, save_steps=4, load_best_model_at_end=True)
    with pytest.raises(ConfigError, match="load_best_model_at_end needs"):
        _config(tmp_path, load_best_model_at_end=True)
    with pytest.raises(ConfigError, match="no eval dataset"):
        GRPOTrainer("builtin:tiny", _length_reward, args=_config(tmp_path, eval_strategy="steps"),
                    train_dataset=arithmetic_dataset(8, seed=0))
    assert cli_main(["export", str(tmp_path), "--best", "--out", str(tmp_path / "x")]) != 0
    assert "has no best.json" in capsys.readouterr().err


def test_recipe_eval_fraction_holds_out_prompts():
    from grpo_ascend.config.recipe import RecipeConfig
    from grpo_ascend.run import train_and_eval_prompts

    data = arithmetic_dataset(20, seed=0)
    recipe = RecipeConfig(eval_fraction=0.25)
    train, held_out = train_and_eval_prompts(recipe, data, seed=0)
    assert len(train) == 15 and len(held_out) == 5
    assert not {json.dumps(p) for p in train["prompt"]} & {json.dumps(p) for p in held_out["prompt"]}
    assert train_and_eval_prompts(RecipeConfig(), data, seed=0) == (data, None)
    _, split = train_and_eval_prompts(RecipeConfig(eval_split="test", max_eval_samples=4), data, seed=0)
    assert len(split) == 4 and split["prompt"] != data["prompt"][:4]  # synthetic: a fresh draw
    with pytest.raises(ConfigError, match="eval_fraction"):
        RecipeConfig(eval_fraction=0.2, eval_split="test")
