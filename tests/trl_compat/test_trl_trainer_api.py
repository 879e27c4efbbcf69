"""TRL 1.16 GRPOTrainer's API on ours (issue 37, group 1): get_high_entropy_mask / get_off_policy_mask with TRL's
signatures, reward_processing_classes, ref_model, entropy_coef, a settable
model and training_step once per micro-batch."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from helpers import SMALL_RUN, first_digit_is_one, fixed_experience, run_round

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.trainers.trl_api import MicroBatchInputs

ENTROPIES = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def _config(tmp_path, **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "num_generations": 2, **kw})


def _trainer(tmp_path, model_dir, lora=True, reward_funcs=first_digit_is_one, **kw):
    return GRPOTrainer(str(model_dir), reward_funcs, _config(tmp_path, **kw), arithmetic_dataset(8),
                       peft_config=default_lora_config(r=4) if lora else None)


def _unbuilt():
    """A trainer object with nothing built but its accelerator (as TRL's own tests make one)."""
    trainer = object.__new__(GRPOTrainer)
    trainer.accelerator = SimpleNamespace(num_processes=1)
    return trainer


@pytest.mark.parametrize("threshold, expected", [
    (0.8, [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]]),  # the top 20% of the 10 valid tokens
    (0.5, [[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0]]),
    (0.0, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),  # every valid token
    (1.0, [[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]]),  # the highest valid one; padding (1.1, 1.2) never counts
])
def test_get_high_entropy_mask_takes_trls_quantile_threshold(threshold, expected):
    got = GRPOTrainer.get_high_entropy_mask(_unbuilt(), ENTROPIES, MASK, threshold)
    assert got.dtype == torch.bool and torch.equal(got, torch.tensor(expected, dtype=torch.bool))
    none = GRPOTrainer.get_high_entropy_mask(_unbuilt(), ENTROPIES, torch.zeros_like(MASK), 0.5)
    assert not none.any()
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\].*got 1\.2"):
        GRPOTrainer.get_high_entropy_mask(_unbuilt(), ENTROPIES, MASK, 1.2)


def test_training_selects_tokens_through_the_overridable_method(tmp_path, tiny_model_dir):
    """top_entropy_quantile ρ calls get_high_entropy_mask(entropies, mask, 1 − ρ), as TRL, so a subclass's
    override decides which tokens train."""
    calls = []

    class Recording(GRPOTrainer):
        def get_high_entropy_mask(self, entropies, mask, threshold):
            calls.append(threshold)
            return super().get_high_entropy_mask(entropies, mask, threshold)

    trainer = Recording(str(tiny_model_dir), first_digit_is_one, _config(tmp_path, top_entropy_quantile=0.25),
                        arithmetic_dataset(8), peft_config=default_lora_config(r=4))
    run_round(trainer, fixed_experience())
    assert calls and all(t == pytest.approx(0.75) for t in calls)


def test_get_off_policy_mask_is_trls_static_method():
    mask = torch.ones(3, 4)
    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])
    sampling, current = torch.zeros(3, 4), torch.zeros(3, 4)
    current[0], current[1], current[2] = -2.0, -0.5, -2.0  # KL 2 (kept: A >= 0), 0.5 (kept), 2 (dropped)
    got = GRPOTrainer.get_off_policy_mask(advantages, current, sampling, mask, 1.0)
    assert got.dtype == mask.dtype and torch.equal(got, torch.tensor([[1.0], [1.0], [0.0]]))
    padded = torch.tensor([[1.0, 1.0, 0.0, 0.0]])  # padding's log-probs do not count in the mean
    logps = torch.tensor([[-2.0, -2.0, -1e4, 1e4]])
    assert GRPOTrainer.get_off_policy_mask(torch.tensor([[-1.0]]), logps, torch.zeros(1, 4), padded, 1.0).item() == 0.0
    logps[0, :2] = -0.5
    assert GRPOTrainer.get_off_policy_mask(torch.tensor([[-1.0]]), logps, torch.zeros(1, 4), padded, 1.0).item() == 1.0


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A reward model: the tiny Qwen2 with a fresh one-logit head, saved with the tiny tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def test_reward_processing_classes_list_one_entry_per_function(tmp_path, tiny_model_dir, rm_dir):
    from transformers import AutoTokenizer

    own = _trainer(tmp_path, tiny_model_dir, reward_funcs=[first_digit_is_one, str(rm_dir)])
    classes = own.reward_processing_classes
    assert classes[0] is None and classes[1] is own.rewards.funcs[1].tokenizer  # loaded with the model, as TRL
    assert classes[1].name_or_path == str(rm_dir)
    given = AutoTokenizer.from_pretrained(rm_dir)
    trainer = GRPOTrainer(str(tiny_model_dir), str(rm_dir), _config(tmp_path), arithmetic_dataset(8),
                          peft_config=default_lora_config(r=4), reward_processing_classes=given)
    assert trainer.reward_processing_classes == [given] and trainer.reward_processing_classes[0] is given


def test_ref_model_is_the_synced_reference(tmp_path, tiny_model_dir):
    assert _trainer(tmp_path, tiny_model_dir).ref_model is None  # beta 0: no reference
    assert _trainer(tmp_path, tiny_model_dir, beta=0.04).ref_model is None  # LoRA: the base, adapters off
    trainer = _trainer(tmp_path, tiny_model_dir, lora=False, beta=0.04, sync_ref_model=True, ref_model_sync_steps=1,
                       learning_rate=1e-3, per_device_train_batch_size=4, steps_per_generation=2)
    reference = trainer.ref_model
    assert isinstance(reference, torch.nn.Module) and reference is not trainer.model
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    run_round(trainer, fixed_experience())
    moved = [n for n, p in trainer.ref_model.named_parameters() if not torch.equal(p, before[n])]
    assert moved and set(moved) <= {n for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_entropy_coef_reads_and_sets_the_adaptive_coefficient(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, tiny_model_dir, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=100.0,
                       entropy_coef_delta=0.005, per_device_train_batch_size=4, steps_per_generation=2)
    assert trainer.entropy_coef == 0.01
    run_round(trainer, fixed_experience())  # two optimizer steps at or below the target: +delta each
    assert trainer.entropy_coef == pytest.approx(0.02) == trainer.entropy_control.coef
    trainer.entropy_coef = 0.3
    assert trainer.entropy_control.coef == 0.3 and trainer.entropy_control.applied() == 0.3


def test_model_is_settable(tmp_path, tiny_model_dir):
    unbuilt = object.__new__(GRPOTrainer)  # TRL's rollout-dispatch tests set the model of a bare trainer
    unbuilt.model = SimpleNamespace(training=True)
    assert unbuilt.model.training is True
    trainer = _trainer(tmp_path, tiny_model_dir, lora=False)
    policy, params = trainer.model, [id(p) for p in trainer.optimizer.param_groups[0]["params"]]
    trainer.model = policy  # the same model: nothing changes
    other = copy.deepcopy(policy)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    trainer.model = other
    assert trainer.model is policy and [id(p) for p in trainer.optimizer.param_groups[0]["params"]] == params
    for (name, p), q in zip(policy.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name  # the new weights, in the trained (optimized, prepared) parameters
    run_round(trainer, fixed_experience())  # and training goes on with them
    assert trainer.step == 1 and any(not torch.equal(p, q) for p, q in zip(policy.parameters(), other.parameters()))
    with pytest.raises(ConfigError, match="its parameters differ from the policy's"):
        trainer.model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="expected a torch nn.Module"):
        trainer.model = "gpt2"


def test_training_step_runs_once_per_micro_batch(tmp_path, tiny_model_dir):
    """TRL's tests wrap training_step to count its calls: one per micro-batch, as there. The losses it returns
    (detached) add up to each step's logged loss."""
    trainer = _trainer(tmp_path, tiny_model_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       steps_per_generation=4, max_steps=2)
    original, returned = GRPOTrainer.training_step, []

    def recording(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        returned.append(loss)
        return loss

    with patch.object(GRPOTrainer, "training_step", autospec=True, side_effect=recording) as spy:
        trainer.train()
    assert spy.call_count == 4  # 2 optimizer steps × 2 micro-batches
    inputs = [call.args[2] for call in spy.call_args_list]
    assert all(isinstance(i, MicroBatchInputs) and len(i.prompts) == 2 for i in inputs)
    assert [i.sync_gradients for i in inputs] == [False, True, False, True]  # gradients reduced on a step's last
    assert all(not loss.requires_grad for loss in returned)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx([(returned[0] + returned[1]).item(),
                                                          (returned[2] + returned[3]).item()], rel=1e-6)


def test_training_step_returns_the_micro_batch_loss(tmp_path, tiny_model_dir):
    """Called alone (num_items_in_batch None) on a step's rows it gives that one-micro-batch step's loss."""
    made = []
    logged = run_round(_trainer(tmp_path / "a", tiny_model_dir, max_steps=1), fixed_experience(), made=made)["loss"]
    exp = made[0]  # the round's experience, its advantages computed
    seen = []

    class Wrapping(GRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            seen.append(loss)
            return loss

    trainer = Wrapping(str(tiny_model_dir), first_digit_is_one, _config(tmp_path / "b", max_steps=1),
                       arithmetic_dataset(8), peft_config=default_lora_config(r=4))
    assert run_round(trainer, fixed_experience())["loss"] == pytest.approx(logged, rel=1e-6)
    assert len(seen) == 1 and not seen[0].requires_grad and seen[0].item() == pytest.approx(logged, rel=1e-6)
    fresh = _trainer(tmp_path / "c", tiny_model_dir, max_steps=1)
    direct = fresh.training_step(fresh.model, MicroBatchInputs(exp, torch.arange(exp.size)))
    assert direct.item() == pytest.approx(logged, rel=1e-5)
    assert any(p.grad is not None for p in fresh.model.parameters() if p.requires_grad)  # backward ran
