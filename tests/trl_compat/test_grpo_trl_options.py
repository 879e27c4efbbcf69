"""TRL 1.16's further GRPO options through our trainer (issue 27 point 5): the GSPO spellings give one run,
normalize_then_sum reaches the advantages, adaptive entropy follows its rule, the reference syncs by
TR-DPO's formula, the head runs in float32, reward_funcs may be left to an environment, TRL's warnings."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math

import pytest
import torch
from helpers import SMALL_RUN, first_digit_is_one, fixed_experience, one_round_gradients, run_round
from transformers import AutoModelForCausalLM

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.algorithms.reward_aggregation import GroupedRewards, aggregate_advantages
from grpo_ascend.checkpoints.checkpoint import TRAINER_STATE_NAME
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.parameters import cast_head_to_fp32, mix_into_reference
from grpo_ascend.models.policy import default_lora_config


def _config(tmp_path, **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "num_generations": 2, **kw})


def _trainer(tmp_path, model, cfg, reward_funcs=first_digit_is_one, lora=True, **kw):
    trainer = GRPOTrainer(model, reward_funcs, cfg, arithmetic_dataset(8),
                          peft_config=default_lora_config(r=4) if lora else None, **kw)
    for name, p in trainer.policy.named_parameters():  # nonzero LoRA B: the adapters change the log-probs
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(name)))
    return trainer


def test_gspo_alias_and_trl_spelling_give_the_same_run(tmp_path, tiny_model_dir):
    trl = pytest.importorskip("trl", reason="trl is not installed")
    trl_cfg = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, loss_type="grpo",
                             importance_sampling_level="sequence", num_generations=2, per_device_train_batch_size=8,
                             max_completion_length=10, learning_rate=5e-3, max_steps=2, logging_steps=1, seed=0,
                             beta=0.04, epsilon_high=0.28, report_to="none", pad_to_multiple_of=16,
                             lr_scheduler_type="constant", activation_checkpointing=False)
    runs = {}
    for name, cfg in (("alias", _config(tmp_path, loss_type="gspo", beta=0.04, epsilon_high=0.28)),
                      ("trl", trl_cfg),
                      ("token", _config(tmp_path, loss_type="grpo", beta=0.04, epsilon_high=0.28))):
        trainer = _trainer(tmp_path, str(tiny_model_dir), cfg)
        assert trainer.args.loss_type == "grpo"
        runs[name] = one_round_gradients(trainer, fixed_experience())
    (alias, alias_metrics), (spelled, spelled_metrics), (token, _) = runs["alias"], runs["trl"], runs["token"]
    assert alias.keys() == spelled.keys() and alias
    for name in alias:
        assert torch.equal(alias[name], spelled[name]), name
    assert alias_metrics["loss"] == spelled_metrics["loss"]
    assert max((alias[n] - token[n]).abs().max() for n in alias) > 1e-6  # sequence-level ratios did change it


def test_normalize_then_sum_reaches_the_advantages(tmp_path, tiny_model_dir):
    def second(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    cfg = _config(tmp_path, multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 3.0])
    trainer = _trainer(tmp_path, str(tiny_model_dir), cfg, reward_funcs=[first_digit_is_one, second])
    exp = fixed_experience()
    per = torch.randn(exp.size, 2, generator=torch.Generator().manual_seed(3)) * torch.tensor([1.0, 40.0])
    exp = dataclasses.replace(exp, rewards_per_function=per, rewards=per @ torch.tensor([1.0, 3.0]),
                              reward_names=["first_digit_is_one", "second"])
    made = []
    run_round(trainer, exp, made=made)
    expected = aggregate_advantages("normalize_then_sum", GroupedRewards(per, exp.rewards, torch.tensor([1.0, 3.0]), 2),
                                    "grpo", "group").advantages
    assert torch.equal(made[0].advantages, expected)
    summed = aggregate_advantages("sum_then_normalize", GroupedRewards(per, exp.rewards, torch.tensor([1.0, 3.0]), 2),
                                  "grpo", "group").advantages
    assert (expected - summed).abs().max() > 0.1


def test_adaptive_entropy_follows_its_rule(tmp_path, tiny_model_dir):
    """Step 1 has no measurement yet: no bonus (the gradient of entropy_coef=0). Each step moves the
    coefficient by delta towards more bonus while the entropy is at or below the target."""
    common = dict(per_device_train_batch_size=4, steps_per_generation=2)
    plain = one_round_gradients(_trainer(tmp_path, str(tiny_model_dir), _config(tmp_path, **common)),
                                fixed_experience())[0]
    cfg = _config(tmp_path, **common, entropy_coef=0.1, use_adaptive_entropy=True, entropy_target=100.0,
                  entropy_coef_delta=0.02, entropy_coef_max=0.13)
    first = one_round_gradients(_trainer(tmp_path, str(tiny_model_dir), cfg), fixed_experience())[0]
    for name in plain:
        torch.testing.assert_close(first[name], plain[name], rtol=0, atol=0)
    trainer = _trainer(tmp_path, str(tiny_model_dir), cfg)
    run_round(trainer, fixed_experience())  # two optimizer steps: 0.1 → 0.12 → 0.13 (the max)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-2:]
    assert [r["entropy_coef"] for r in records] == pytest.approx([0.12, 0.13])
    assert trainer.entropy_control.last_entropy == pytest.approx(records[-1]["entropy"], rel=1e-5)
    saved = json.loads((trainer.save_checkpoint() / TRAINER_STATE_NAME).read_text())["entropy_control"]
    assert saved == {"coef": pytest.approx(0.13), "last_entropy": trainer.entropy_control.last_entropy}
    # Above the target the bonus is off and the coefficient falls towards entropy_coef_min.
    low = _trainer(tmp_path, str(tiny_model_dir), _config(tmp_path, **common, entropy_coef=0.1, use_adaptive_entropy=True,
                                                          entropy_target=0.0, entropy_coef_delta=0.03))
    run_round(low, fixed_experience())
    assert low.entropy_control.coef == pytest.approx(0.04) and low.entropy_control.applied() == 0.0


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, per_device_train_batch_size=4, steps_per_generation=2, beta=0.04, sync_ref_model=True,
                  ref_model_mixup_alpha=0.6, ref_model_sync_steps=2, learning_rate=1e-3)
    trainer = _trainer(tmp_path, str(tiny_model_dir), cfg, lora=False)
    reference = trainer.ref_logprob_model.model
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    run_round(trainer, fixed_experience())  # steps 1 and 2: one sync, after step 2
    policy = dict(trainer.policy.named_parameters())
    moved = 0
    for name, p in reference.named_parameters():
        torch.testing.assert_close(p, 0.6 * policy[name].detach() + 0.4 * before[name], rtol=0, atol=1e-6)
        moved += int(not torch.equal(p, before[name]))
    assert moved > 0
    mixed = {n: p.detach().clone() for n, p in reference.named_parameters()}
    checkpoint = trainer.save_checkpoint()
    with torch.no_grad():
        for p in reference.parameters():
            p.zero_()
    trainer.load_checkpoint(checkpoint)  # the synced reference is checkpointed and comes back
    assert all(torch.equal(p, mixed[n]) for n, p in reference.named_parameters())


def test_mix_into_reference_formula():
    policy = torch.nn.Linear(3, 2)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        reference.weight.fill_(1.0)
        reference.bias.fill_(-1.0)
    mix_into_reference(reference, policy, 0.25)
    torch.testing.assert_close(reference.weight, 0.25 * policy.weight.detach() + 0.75)
    torch.testing.assert_close(reference.bias, 0.25 * policy.bias.detach() - 0.75)
    with pytest.raises(ConfigError, match="different parameters"):
        mix_into_reference(torch.nn.Linear(3, 2, bias=False), policy, 0.5)


def test_sync_ref_model_is_refused_under_lora(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="sync_ref_model=True with a LoRA"):
        _trainer(tmp_path, str(tiny_model_dir), _config(tmp_path, beta=0.04, sync_ref_model=True))


def _untied_bf16(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    return model.to(torch.bfloat16)


def test_fp32_head_gives_float32_logits_of_the_hidden_states(tiny_model_dir):
    model = _untied_bf16(tiny_model_dir)
    head_bf16 = model.get_output_embeddings().weight.detach().clone()
    cast_head_to_fp32(model)
    head = model.get_output_embeddings()
    assert head.weight.dtype == torch.float32 and torch.equal(head.weight, head_bf16.float())
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    ids = torch.tensor([[5, 17, 300, 42]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, output_hidden_states=True)
        copied = copy.deepcopy(model)(ids)  # the reference is a deep copy: it keeps the float32 head
    assert out.logits.dtype == torch.float32 and copied.logits.dtype == torch.float32
    expected = out.hidden_states[-1].float() @ head.weight.T
    torch.testing.assert_close(out.logits, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(copied.logits, out.logits, rtol=0, atol=0)


def test_fp32_head_in_the_trainer(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, _untied_bf16(tiny_model_dir), _config(tmp_path, cast_lm_head_to_fp32=True))
    assert trainer.policy.get_output_embeddings().weight.dtype == torch.float32
    logps, _ = trainer.logprob_model(*fixed_experience().model_inputs(slice(0, 2)))
    assert logps.dtype == torch.float32
    def alternating(prompts, completions, **kwargs):  # differs within every group by construction
        return [float(i % 2) for i in range(len(completions))]

    tied = _trainer(tmp_path, str(tiny_model_dir), _config(tmp_path, cast_lm_head_to_fp32=True, max_steps=1),
                    reward_funcs=alternating)
    tied.train()  # rollout, reference-free loss and a step through the float32 head of a tied model
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1 and math.isfinite(record["loss"]) and record["grad_norm"] > 0
    from peft import LoraConfig, get_peft_model

    adapted_head = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                  LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ConfigError, match="not a plain Linear"):  # TRL refuses an adapter on the head too
        cast_head_to_fp32(adapted_head)


def test_fp32_head_tied_to_the_embeddings(tiny_model_dir):
    """The tiny model ties its head (as TRL's Gemma2 test model): the shared weight becomes float32, the
    embeddings still hand the decoder the model's dtype, and the logits are the float32 product."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(torch.bfloat16)
    cast_head_to_fp32(model)
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embeddings.weight and head.weight.dtype == torch.float32
    ids = torch.tensor([[5, 17, 300, 42]])
    assert embeddings(ids).dtype == torch.bfloat16
    out = model(ids, output_hidden_states=True)
    assert out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, out.hidden_states[-1].float() @ head.weight.T, rtol=0, atol=1e-5)


class ScoredEnv:
    def reset(self, **row):
        self.calls = 0

    def look(self) -> str:
        """Look around."""
        self.calls += 1
        return "nothing"

    def get_reward(self) -> float:
        return 1.0


class UnscoredEnv:
    def reset(self, **row):
        pass

    def look(self) -> str:
        """Look around."""
        return "nothing"


def test_reward_funcs_may_be_left_to_an_environment(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(str(tiny_model_dir), args=_config(tmp_path), train_dataset=arithmetic_dataset(8),
                          peft_config=default_lora_config(r=4), environment_factory=ScoredEnv)
    assert trainer.rewards.names == ["ScoredEnv"] and trainer.rewards.weights == [1.0]
    no_source = (r"No reward source provided\. Pass `reward_funcs`, or an `environment_factory` whose environment "
                 r"defines a `get_reward` method\.")
    with pytest.raises(ConfigError, match=no_source):
        GRPOTrainer(str(tiny_model_dir), args=_config(tmp_path), train_dataset=arithmetic_dataset(8))
    with pytest.raises(ConfigError, match=no_source):  # an environment without get_reward scores nothing
        GRPOTrainer(str(tiny_model_dir), args=_config(tmp_path), train_dataset=arithmetic_dataset(8),
                    environment_factory=UnscoredEnv)


@pytest.mark.parametrize("loss_type, level, warned", [
    ("dapo", "sequence", "the 'dapo' loss sums per-token contributions"),
    ("cispo", "sequence", "the 'cispo' loss sums per-token contributions"),
    ("grpo", "sequence", None),
    ("luspo", "token", "'luspo' loss, importance_sampling_level should be set to 'sequence'"),
    ("vespo", "sequence", "VESPO computes sequence-level importance weights internally"),
])
def test_trl_warnings_for_level_and_loss_type(tmp_path, tiny_model_dir, caplog, loss_type, level, warned):
    with caplog.at_level(logging.WARNING, logger="grpo_ascend.trainers.grpo"):
        GRPOTrainer(str(tiny_model_dir), first_digit_is_one,
                    _config(tmp_path, loss_type=loss_type, importance_sampling_level=level), arithmetic_dataset(8),
                    peft_config=default_lora_config(r=4))
    messages = [r.getMessage() for r in caplog.records if r.name == "grpo_ascend.trainers.grpo"]
    if warned is None:
        assert not messages
    else:
        assert any(warned in m for m in messages), messages


def test_an_adapter_on_the_lm_head_trains_also_with_use_liger_kernel(tmp_path, tiny_model_dir):
    """TRL refuses PEFT on lm_head when Liger's fused loss is asked for; here use_liger_kernel is ignored (no
    Liger path: our chunked log-probs read the head through its adapter) and the head's adapter trains."""
    from helpers import index_in_group

    cfg = _config(tmp_path, max_steps=1, use_liger_kernel=True)
    trainer = GRPOTrainer(str(tiny_model_dir), index_in_group(cfg.num_generations), cfg, arithmetic_dataset(8),
                          peft_config=default_lora_config(r=4, target_modules=["q_proj", "lm_head"]))
    head = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if "lm_head" in n and "lora_B" in n}
    trainer.train()
    after = dict(trainer.policy.named_parameters())
    assert head and all(not torch.equal(after[n], before) for n, before in head.items())
