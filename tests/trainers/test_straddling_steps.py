"""steps_per_generation not a multiple of gradient_accumulation_steps (TRL allows it): micro-batches are
taken in order and an optimizer step may straddle two generation batches, each micro-batch normalised by
its own generation batch (TRL's dapo rule: its tokens × gradient_accumulation_steps / steps_per_generation)."""

from __future__ import annotations

import json

import torch
from helpers import SMALL_RUN, first_digit_is_one, uninterrupted_and_resumed

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.trainers.base import RoundLog
from grpo_ascend.trainers.step_segments import Segment, step_log, step_parts


def test_step_parts_carry_the_remainder():
    stream = torch.arange(6)
    assert [(p.tolist(), done) for p, done in step_parts(stream, 4, 0)] == [([0, 1, 2, 3], True), ([4, 5], False)]
    assert [(p.tolist(), done) for p, done in step_parts(stream, 4, 2)] == [([0, 1], True), ([2, 3, 4, 5], True)]
    assert [(p.tolist(), done) for p, done in step_parts(torch.arange(2), 4, 0)] == [([0, 1], False)]


def test_a_batch_that_completes_no_step_is_averaged_into_the_next_log():
    first = RoundLog({"reward": 1.0, "only_first": 4.0}, timer=None, prep_seconds=2.0)
    second = RoundLog({"reward": 3.0}, timer=None, prep_seconds=1.0)
    log = step_log([Segment(None, torch.arange(2), None, first), Segment(None, torch.arange(2), None, second)])
    assert log is second and log.metrics == {"reward": 2.0, "only_first": 4.0} and log.prep_seconds == 3.0
    again = step_log([Segment(None, torch.arange(2), None, first), Segment(None, torch.arange(2), None, second)])
    assert again.metrics == {"reward": 2.0, "only_first": 4.0}  # charged once


def test_steps_straddle_generation_batches_in_trls_order(tmp_path, tiny_model_dir):
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "num_generations": 2,
                        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                        "steps_per_generation": 3, "max_steps": 3, "loss_type": "dapo"})
    micro_batches, made = [], []  # (optimizer step, generation batch, rows) of each micro-batch, in order

    class Recording(GRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            micro_batches.append((self.step, id(inputs.experience), inputs.rows.tolist()))
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Recording(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(12),
                        peft_config=default_lora_config(r=4))
    make = trainer.experience.make

    def recording_make(*args, **kwargs):
        exp, metrics = make(*args, **kwargs)
        made.append((exp, kwargs["old_logps"]))
        return exp, metrics

    trainer.experience.make = recording_make
    trainer.train()
    steps = []  # each optimizer step's segments: (generation batch, its rows in the step)
    for step, exp_id, rows in micro_batches:
        if len(steps) == step:
            steps.append([])
        if steps[step] and steps[step][-1][0] == exp_id:
            steps[step][-1][1].extend(rows)
        else:
            steps[step].append((exp_id, list(rows)))
    assert [old for _, old in made] == [True, True]  # 2 % 3 != 0: TRL computes old log-probs
    assert all(exp.old_logps is not None for exp, _ in made)
    a, b = id(made[0][0]), id(made[1][0])
    assert [[(e, len(r)) for e, r in step] for step in steps] == [[(a, 4)], [(a, 2), (b, 2)], [(b, 4)]]
    first_a, second_a = steps[0][0][1], steps[1][0][1]
    assert sorted(first_a + second_a) == list(range(6))  # every row of batch A exactly once, in stream order
    assert sorted(steps[1][1][1] + steps[2][0][1]) == list(range(6))
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3] and trainer.step == 3


def test_a_straddling_step_normalises_each_micro_batch_by_its_own_batch(tmp_path, tiny_model_dir):
    """dapo: Σ_micro Σ tokens L / (tokens of its generation batch × GA / spg), as TRL's num_items_in_batch rule."""
    from grpo_ascend.distributed.ranks import Ranks
    from grpo_ascend.trainers.step_segments import straddling_normalisers

    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "num_generations": 2,
                        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                        "steps_per_generation": 3})
    trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(12),
                          peft_config=default_lora_config(r=4))
    from helpers import fixed_experience

    exp_a, exp_b = fixed_experience(n=6), fixed_experience(n=6)
    exp_b.loss_mask[0, 1:] = 0
    tokens_a, tokens_b = exp_a.loss_mask.sum(), exp_b.loss_mask.sum()
    segments = [Segment(exp_a, torch.tensor([4, 5]), tokens_a, None), Segment(exp_b, torch.tensor([0, 1]), tokens_b, None)]
    norms = straddling_normalisers(segments, Ranks(trainer.accelerator), grad_accum=2, steps_per_generation=3)
    assert [n.num_sequences for n in norms] == [4, 4]
    step_tokens = exp_a.loss_mask[[4, 5]].sum() + exp_b.loss_mask[[0, 1]].sum()
    assert all(n.num_tokens == step_tokens for n in norms)
    assert [float(n.num_tokens_per_step_global) for n in norms] == [float(tokens_a * 2 / 3), float(tokens_b * 2 / 3)]


def test_resume_is_exact_with_straddling_steps_a_synced_reference_and_adaptive_entropy(tmp_path, tiny_model_dir):
    """Saves fall where steps line up with generation batches; the synced reference and the entropy
    controller are checkpointed: a run killed after its first save and resumed ends where an
    uninterrupted one does, bit for bit."""

    def alternating(prompts, completions, **kwargs):  # differs within every group by construction
        return [float(i % 2) for i in range(len(completions))]

    def make(out):
        cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(out), "num_generations": 2, "per_device_train_batch_size": 2,
                            "gradient_accumulation_steps": 2, "steps_per_generation": 3, "max_steps": 6,
                            "save_steps": 3, "beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 2,
                            "ref_model_mixup_alpha": 0.5, "learning_rate": 1e-3, "entropy_coef": 0.01,
                            "use_adaptive_entropy": True, "entropy_target": 100.0, "entropy_coef_delta": 0.01})
        return GRPOTrainer(str(tiny_model_dir), alternating, cfg, arithmetic_dataset(12, seed=3))

    def state(trainer):
        return ({n: p.detach().clone() for n, p in trainer.policy.named_parameters()},
                {n: p.detach().clone() for n, p in trainer.ref_logprob_model.model.named_parameters()},
                trainer.entropy_control.state_dict())

    expected, got, preempted_at = uninterrupted_and_resumed(lambda name: make(tmp_path / name), state)
    assert preempted_at == 3
    for want, have in zip(expected[:2], got[:2]):
        assert want.keys() == have.keys()
        assert all(torch.equal(want[k], have[k]) for k in want)
    assert got[2] == expected[2] and expected[2]["coef"] == 0.07  # 0.01 + 6 steps × 0.01
