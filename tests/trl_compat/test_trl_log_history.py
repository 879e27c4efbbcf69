"""trainer.state.log_history and train()'s return value as transformers' Trainer / TRL 1.16's GRPOTrainer have
them: TRL's metric names beside ours, averaged over the steps since the last log, a closing summary entry and a
TrainOutput. Where cheap, the same tiny run goes through TRL's own trainer and the keys are compared."""

from __future__ import annotations

import json
import warnings

import pytest
from datasets import Dataset

from grpo_ascend import GRPOConfig, GRPOTrainer

SUMMARY_KEYS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
                "epoch", "step"}
#: TRL's per-sequence extremes of the clipped fractions: not computed here (docs/trl_compatibility.md).
NOT_LOGGED = {"clip_ratio/low_min", "clip_ratio/high_max"}
# One prompt of 4 completions per optimizer step: one generation round per step.
RUN = dict(max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=6, logging_steps=1,
           report_to="none", bf16=False, learning_rate=1e-3, save_strategy="no", disable_tqdm=True, beta=0.04,
           entropy_coef=0.01, seed=0)


def _prompts():
    return Dataset.from_list([{"prompt": f"Count to {i}:"} for i in range(8)])


def _recording_reward(calls):
    def length(completions, **kwargs):
        values = [float(len(c)) + i for i, c in enumerate(completions)]  # differs within every group
        calls.append(sum(values) / len(values))
        return values
    return length


def _train(trainer_cls, config_cls, tiny_model_dir, out, calls, **changes):
    args = config_cls(output_dir=str(out), **{**RUN, **changes})
    trainer = trainer_cls(model=str(tiny_model_dir), reward_funcs=_recording_reward(calls), args=args,
                          train_dataset=_prompts())
    return trainer, trainer.train()


def test_summary_entry_and_train_output_as_trls(tmp_path, tiny_model_dir):
    from transformers.trainer_utils import TrainOutput

    trainer, output = _train(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path / "ours", [])
    history = trainer.state.log_history
    assert [e["step"] for e in history] == [1, 2, 2]
    summary = history[-1]
    assert set(summary) == SUMMARY_KEYS  # nothing left over: step 2 was logged
    assert isinstance(output, TrainOutput) and output.global_step == 2
    assert output.metrics == {k: v for k, v in summary.items() if k != "step"}
    assert output.training_loss == summary["train_loss"] == (history[0]["loss"] + history[1]["loss"]) / 2
    assert summary["train_samples_per_second"] == pytest.approx(2 * 4 / summary["train_runtime"], rel=0.01, abs=1e-3)
    assert summary["total_flos"] > 0 and trainer.state.total_flos == summary["total_flos"]
    for entry in history[:2]:  # TRL's names beside ours, the same values where they are the same quantity
        assert entry["completions/mean_length"] == entry["completion_length/mean"]
        assert entry["completions/clipped_ratio"] == entry["truncated_fraction"]
        assert entry["clip_ratio/region_mean"] == entry["clip_ratio/region"]
        assert entry["entropy_coef"] == 0.01 and entry["policy_loss"] != entry["loss"]
    assert history[1]["num_tokens"] == trainer.state.num_input_tokens_seen > history[0]["num_tokens"]
    # the run summary train() used to return is kept, as summary.json has it
    assert trainer.run_summary == json.loads((tmp_path / "ours" / "summary.json").read_text())

    trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl==1.16.0)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, reference_output = _train(trl.GRPOTrainer, trl.GRPOConfig, tiny_model_dir, tmp_path / "trl", [],
                                             use_cpu=True)
    trl_history = reference.state.log_history
    assert set(trl_history[-1]) == set(summary)
    assert type(reference_output) is type(output) and reference_output.global_step == output.global_step
    assert set(trl_history[0]) - NOT_LOGGED <= set(history[0])


def test_entries_average_the_steps_since_the_last_log_as_trl(tmp_path, tiny_model_dir):
    """logging_steps=2 over 3 steps: an entry at step 2 averages rounds 1 and 2; round 3 lands in the summary."""
    calls = []
    trainer, output = _train(GRPOTrainer, GRPOConfig, tiny_model_dir, tmp_path, calls, max_steps=3, logging_steps=2)
    assert len(calls) == 3  # one generation round per step
    history = trainer.state.log_history
    assert [e["step"] for e in history] == [2, 3]
    step2, summary = history
    assert step2["reward"] == pytest.approx((calls[0] + calls[1]) / 2, rel=1e-6)
    assert summary["reward"] == pytest.approx(calls[2], rel=1e-6)
    assert set(summary) - SUMMARY_KEYS >= {"reward", "entropy", "completions/mean_length", "num_tokens"}
    assert not {"loss", "grad_norm", "learning_rate"} & set(summary)  # transformers logs these at log steps only
    # metrics.jsonl keeps our own records: each logged step's own values, and the last step
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3]
    assert records[0]["reward"] == pytest.approx(calls[1], rel=1e-6)
    assert output.metrics["reward"] == summary["reward"]


def test_window_averages_skip_nan_and_use_trls_names_per_loss_type():
    """TRL's log(): each name's values since the last entry averaged without NaN (None when all are NaN);
    grad_norm / learning_rate are the last step's; the clipped fractions get the loss type's TRL name."""
    from transformers import TrainerState

    from grpo_ascend.trainers.trl_logs import TRLLogHistory

    nan = float("nan")
    log = TRLLogHistory(TrainerState(), "dapo", 0.0, 0, 4)
    log.add_step({"loss": nan, "entropy": nan, "grad_norm": 2.0, "clip_ratio/high": 0.5, "ratio/mean": 1.0})
    log.add_step({"loss": 1.0, "entropy": nan, "grad_norm": 3.0, "clip_ratio/high": 0.25, "time/step": 2.0})
    assert log.flush() == {"loss": 1.0, "entropy": None, "grad_norm": 3.0, "clip_ratio/high_mean": 0.375,
                           "step_time": 2.0}
    assert log.flush() == {}  # cleared, as TRL clears its metrics after each log
    cispo = TRLLogHistory(TrainerState(), "cispo", 0.0, 0, 4)
    cispo.add_step({"clip_ratio/low": 0.0, "clip_ratio/high": 0.25})
    assert cispo.flush() == {"cispo_clip_ratio": 0.25}
    sapo = TRLLogHistory(TrainerState(), "sapo", 0.0, 0, 4)  # TRL logs no clipped fraction for sapo
    sapo.add_step({"clip_ratio/high": 0.25})
    assert sapo.flush() == {}
