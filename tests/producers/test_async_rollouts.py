"""Rollouts ahead of training: the rollout process (parity, versions, restarts), the producer's staleness
rules and ledger, and learning under ``one_step_off`` / ``async``."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import (
    SMALL_RUN,
    first_digit_is_one,
    index_in_group,
    perturb_weights,
    rewards_before_and_after_training,
    train_until_preempted,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.config.trl_compat import from_trl_async_config
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.errors import ConfigError, RolloutError, RolloutInterrupted
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.models.sampler_copy import sampler_copy, synced_tensors
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.process.client import ProcessBackend, ProcessSettings
from grpo_ascend.rollout.process.weight_ring import WeightRing, spawn_context
from grpo_ascend.rollout.process.worker import RolloutServer, WorkerSpec
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.tracking.plot import panels_of


def _seed_of(seed: int) -> int:
    """The seed a rollout process's generator gets from a caller's generator seeded with ``seed``."""
    return int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(seed)).item())


def test_rollout_process_samples_as_the_engine_follows_versions_and_survives_a_kill(tiny_model_dir):
    """Same weights and seed: the same tokens and log-probs as the in-process engine; a pushed version is
    sampled from (and tagged on every token); a pinned one stays; a killed process is restarted."""
    model = perturb_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(num_generations=3, max_completion_length=12, temperature=1.0)
    engine = RolloutEngine(model, tok, params)
    ids = [tok("hello there").input_ids, tok("one two").input_ids]
    remote = ProcessBackend(model, tok, params, ProcessSettings(threads=1, max_restarts=1), torch.device("cpu"), 0)
    try:
        local = engine.generate_ids(ids, params, torch.Generator().manual_seed(_seed_of(3)))
        sampled = remote.generate_ids(ids, params, torch.Generator().manual_seed(3))
        assert torch.equal(local.completion_ids, sampled.completion_ids)
        # the same maths; the process may pick another matmul layout (device calibration): float noise only
        torch.testing.assert_close(local.sampling_logprobs, sampled.sampling_logprobs, rtol=0, atol=1e-5)
        assert sampled.policy_versions.unique().tolist() == [0]

        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02)
        remote.sync_weights(PolicyWeights(model, 5))
        moved = engine.generate_ids(ids, params, torch.Generator().manual_seed(_seed_of(3)))
        assert not torch.equal(moved.sampling_logprobs, local.sampling_logprobs)
        newest = remote.generate_ids(ids, params, torch.Generator().manual_seed(3))
        assert torch.equal(newest.completion_ids, moved.completion_ids)
        assert newest.policy_versions.unique().tolist() == [5] and remote.last_version == 5

        os.kill(remote.pid, signal.SIGKILL)
        again = remote.generate_ids(ids, params, torch.Generator().manual_seed(3))  # restarted, newest weights
        assert remote.restarts == 1 and torch.equal(again.completion_ids, moved.completion_ids)
        os.kill(remote.pid, signal.SIGKILL)
        with pytest.raises(RolloutError, match="after 1 restarts"):
            remote.generate_ids(ids, params, torch.Generator().manual_seed(3))
    finally:
        remote.close()


def test_a_frozen_rollout_process_or_a_stuck_weight_sync_ends_the_run_with_one_line(tiny_model_dir):
    """A process whose heartbeat stops (frozen here with SIGSTOP) fails the request after
    heartbeat_stale_after_s instead of hanging it; a weight push that cannot take its slot fails after
    weight_sync_timeout."""
    import time

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(num_generations=2, max_completion_length=4)
    remote = ProcessBackend(model, tok, params, ProcessSettings(threads=1, heartbeat_stale_after_s=1.5,
                                                                weight_sync_timeout=0.5), torch.device("cpu"), 0)
    try:
        ids = [tok("hello").input_ids]
        remote.generate_ids(ids, params)
        remote.ring.locks[0].acquire()  # a reader that never lets go of the slot the next push writes
        started = time.monotonic()
        with pytest.raises(RolloutError, match="weight_sync_timeout=0.5"):
            remote.sync_weights(PolicyWeights(model, 1))
        assert time.monotonic() - started < 5
        remote.ring.locks[0].release()
        os.kill(remote.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RolloutError, match="heartbeat stopped"):
            remote.generate_ids(ids, params)
        assert time.monotonic() - started < 10
    finally:
        if remote.pid is not None:
            os.kill(remote.pid, signal.SIGKILL)
        remote.close()


def _trained_groups(trainer):
    """Wrap the source so each round's trained group ids (and their sampling versions) are recorded."""
    seen = []
    take = trainer.experience.source.next_scored

    def recording(*a, **kw):
        exp = take(*a, **kw)
        seen.append((trainer.step, exp.group_ids[:: trainer.plan.num_generations].tolist(),
                     exp.policy_versions.min().item(), exp.policy_versions.max().item()))
        return exp

    trainer.experience.source.next_scored = recording
    return seen


def _run(tmp_path, model_dir, name, **kw):
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / name), "max_steps": 5, **kw})
    trainer = GRPOTrainer(str(model_dir), index_in_group(cfg.num_generations), cfg, arithmetic_dataset(40, seed=1),
                          peft_config=default_lora_config(r=4))
    seen = _trained_groups(trainer)
    trainer.train()
    return trainer, seen


def test_one_step_off_samples_each_batch_with_the_weights_one_round_old(tmp_path, tiny_model_dir):
    """Batch k is sampled with version k - 1 exactly (batch 0 with the start); prompts in draw order, each once."""
    trainer, seen = _run(tmp_path, tiny_model_dir, "one_step_off", rollout_mode="one_step_off")
    assert [(step, lo, hi) for step, _, lo, hi in seen] == [(0, 0, 0), (1, 0, 0), (2, 1, 1), (3, 2, 2), (4, 3, 3)]
    assert [g for _, groups, _, _ in seen for g in groups] == list(range(10))
    staleness = [r["async/staleness_max"] for r in trainer.state.log_history if "async/staleness_max" in r]
    assert staleness == [0.0, 1.0, 1.0, 1.0, 1.0]
    pushes = [(r["async/weight_pushes"], r["async/weight_push_s"]) for r in trainer.state.log_history
              if "async/weight_pushes" in r]  # each round's: the start's push, then one after every step
    assert [n for n, _ in pushes] == [1.0] * 5 and all(0 < s < 30 for _, s in pushes)
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in r]
    after = trainer.rollout.generate_rows([{"prompt": "1+1="}])  # train() closed the process: a new one starts
    assert trainer.rollout.backend.restarts == 0 and after.policy_versions.unique().tolist() == [5]
    # step 1: the sampler's and the trainer's weights are the same (float noise); later, one step apart
    assert len(gaps) == 5 and gaps[0] < 1e-5 and min(gaps[1:]) > 100 * gaps[0]
    # a second train(): what the first left sampled ahead (draw 5) is sampled again with its start's weights
    trainer.max_steps = 7
    trainer.train()
    assert [(step, groups, lo, hi) for step, groups, lo, hi in seen[5:]] == [(5, [10, 11], 5, 5), (6, [12, 13], 5, 5)]


def test_async_drops_stale_groups_and_samples_their_prompts_again(tmp_path, tiny_model_dir):
    """max_staleness 0 with the producer running rounds ahead: groups older than the step are dropped and
    counted, their prompts sampled again; every trained group is fresh, no prompt is lost or trained twice."""
    trainer, seen = _run(tmp_path, tiny_model_dir, "async", rollout_mode="async", max_staleness=0,
                         max_inflight_tasks=6)
    assert all(lo == hi == step for step, _, lo, hi in seen)
    trained = [g for _, groups, _, _ in seen for g in groups]
    assert len(trained) == len(set(trained)) == 10
    dropped = sum(r.get("async/dropped_groups", 0.0) for r in trainer.state.log_history)
    assert dropped > 0
    assert trainer.state.log_history[-2]["sampling/importance_sampling_ratio/mean"] > 0  # IS correction on by default


def test_interrupted_async_run_resumes_with_no_prompt_lost_or_trained_twice(tmp_path, tiny_model_dir):
    """Ctrl-C right after the checkpoint at step 2, with the producer rounds ahead: the producer and the rollout
    process stop with the trainer; the resumed run trains every draw the first did not, none twice (the
    checkpoint's ledger), and its steps continue from 3."""
    def make(name):
        cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / name), "max_steps": 5, "save_steps": 2,
                            "rollout_mode": "async", "max_staleness": 4})
        trainer = GRPOTrainer(str(tiny_model_dir), index_in_group(cfg.num_generations), cfg,
                              arithmetic_dataset(40, seed=1), peft_config=default_lora_config(r=4))
        return trainer, _trained_groups(trainer)

    first, first_seen = make("run")
    train_until_preempted(first, step=2)
    assert not first.experience.source.running and first.rollout.backend.pid is None  # both stopped with train()
    resumed, resumed_seen = make("run")
    resumed.train(resume_from_checkpoint="latest")
    before = [g for _, groups, _, _ in first_seen for g in groups]
    after = [g for _, groups, _, _ in resumed_seen for g in groups]
    assert [step for step, *_ in resumed_seen] == [2, 3, 4]
    assert len(before) == 4 and len(after) == 6 and sorted(before + after) == list(range(10))


def test_rollout_ahead_refuses_what_cannot_run_ahead():
    with pytest.raises(ConfigError, match="vllm_mode: server"):
        GRPOConfig(rollout_mode="async", use_vllm=True)
    with pytest.raises(ConfigError, match="did you mean 'async'"):
        GRPOConfig(rollout_mode="asinc")
    with pytest.raises(ConfigError, match="max_staleness"):
        GRPOConfig(rollout_mode="async", max_staleness=-1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_reward_rises_with_rollouts_ahead_of_training(tmp_path, tiny_warm_model_dir, mode):
    """The sync learning test's run (test_grpo_trainer.py) with rollouts ahead: the held-out reward ends far
    above the control (the same evaluation before training); async at max_staleness 1."""
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / mode), "max_steps": 30,
                        "per_device_train_batch_size": 32, "num_generations": 8, "learning_rate": 5e-3,
                        "max_completion_length": 8, "temperature": 1.0, "per_device_eval_batch_size": 256,
                        "rollout_mode": mode, "max_staleness": 1})
    trainer = GRPOTrainer(str(tiny_warm_model_dir), first_digit_is_one, cfg, arithmetic_dataset(400, seed=5),
                          peft_config=default_lora_config(r=8))
    control, trained = rewards_before_and_after_training(trainer, arithmetic_dataset(64, seed=6))
    assert trained > control + 0.3, (trained, control)


@pytest.mark.parametrize("mode", ["continue", "abort"])
def test_a_version_pushed_mid_request_is_taken_as_partial_rollouts_says(tiny_model_dir, mode):
    """continue: later tokens are sampled (and tagged) with the new version, earlier ones keep theirs, and
    they are the tokens the new weights give from that point; abort: the request starts again once with the
    new version (its tokens as if it had started with it), the thrown-away token slots counted.
    The rollout process's server runs in this process here, a push landing after its 5th token."""
    model = perturb_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(num_generations=2, max_completion_length=24, temperature=0.0, ignore_eos=True)
    ring = WeightRing(dict(synced_tensors(model)), spawn_context())
    spec = WorkerSpec(sampler_copy(model), tok, params, "cpu", None, "fp32", 0, 10.0, mode)
    server = RolloutServer(spec, ring)
    newer = perturb_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), seed=3)
    take = server.take_newer_weights

    def push_then_take(sampled):
        if sampled == 5:
            ring.write(7, synced_tensors(newer), timeout=10)
        take(sampled)

    server.take_newer_weights = push_then_take
    ids = [tok("hello there").input_ids]
    batch = server.generate(ids, params, None, None, None)
    versions = batch.policy_versions[0].tolist()
    fresh = RolloutEngine(newer, tok, params).generate_ids(ids, params)
    if mode == "continue":
        assert versions == [0] * 5 + [7] * 19 and batch.timing["aborted_tokens"] == 0
        old = RolloutEngine(model, tok, params).generate_ids(ids, params)
        assert batch.completion_ids[0, :5].tolist() == old.completion_ids[0, :5].tolist()
        assert batch.completion_ids[0].tolist() != old.completion_ids[0].tolist()
    else:
        assert versions == [7] * 24 and batch.timing["aborted_tokens"] == 5 * 2
        assert torch.equal(batch.completion_ids, fresh.completion_ids)


def test_an_open_session_keeps_its_weights_while_other_requests_load_newer_ones(tiny_model_dir):
    """A multi-turn session (the producer's tool loop) advances on the version it started with, even after an
    evaluation's request loaded a newer one in between; once two newer versions have pushed its own out of the
    ring, the session ends and its caller is told to sample the rows again (RolloutInterrupted), not fed
    tokens of weights it was not tagged with."""
    model = perturb_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval())
    newer = perturb_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), seed=3)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = SamplingParams(num_generations=1, max_completion_length=6, temperature=0.0, ignore_eos=True)
    ring = WeightRing(dict(synced_tensors(model)), spawn_context())
    server = RolloutServer(WorkerSpec(sampler_copy(model), tok, params, "cpu", None, "fp32", 0, 10.0, "continue"), ring)
    ids = [tok("hello there").input_ids]
    ring.write(0, synced_tensors(model), timeout=10)
    assert server.start_session(1, ids, params, None, None) == 0
    ring.write(1, synced_tensors(newer), timeout=10)
    server.generate(ids, params, None, None, None)  # an evaluation's request: loads version 1
    server.advance(1)
    reference = RolloutEngine(model, tok, params).generate_ids(ids, params)
    out = server.output(1)
    assert out.completion_ids[0, :6].tolist() == reference.completion_ids[0].tolist()
    assert out.policy_versions.unique().tolist() == [0]  # every token tagged with the session's version
    server.start_session(2, ids, params, None, 0)
    ring.write(2, synced_tensors(newer), timeout=10)  # versions 2 and 1 in the ring: 0 is gone
    server.generate(ids, params, None, None, None)
    with pytest.raises(RolloutInterrupted, match="sampled again"):
        server.advance(2)
    assert 2 not in server.sessions


def test_plot_panels_follow_what_a_run_logged():
    """A sync run without KL gets no KL panel; an asynchronous run gets its staleness and idle panels."""
    sync = [{"step": 1, "reward": 0.5, "rewards/acc/mean": 0.5, "time/step": 1.0, "completion_length/mean": 9.0}]
    titles = [title for title, _ in panels_of(sync)]
    assert titles == ["reward", "completion length (tokens)", "seconds per step"]
    assert panels_of(sync)[0][1] == ["reward", "rewards/acc/mean"]
    ahead = [{**sync[0], "kl": 0.1, "async/staleness_mean": 1.0, "async/staleness_max": 2.0,
              "async/producer_idle_fraction": 0.3, "async/trainer_idle_fraction": 0.0}]
    assert [title for title, _ in panels_of(ahead)] == [
        "reward", "KL to reference", "completion length (tokens)", "seconds per step", "staleness (policy versions)",
        "idle fraction (asynchronous rollouts)"]


def test_trls_async_grpo_config_maps_to_asynchronous_rollouts_on_its_server(tmp_path):
    """TRL's AsyncGRPOConfig: its asynchronous settings kept under their names, the fields it shares with TRL's
    GRPOConfig mapped as for that one, its own settings without a counterpart ignored with a warning."""
    import warnings

    pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.async_grpo import AsyncGRPOConfig

        trl_cfg = AsyncGRPOConfig(output_dir=str(tmp_path), max_staleness=2, weight_sync_steps=3, queue_maxsize=64,
                                  vllm_server_base_url="http://127.0.0.1:8011", learning_rate=1e-5,
                                  fork_threshold_tokens=5, bf16=False, use_cpu=True)
    with pytest.warns(Warning, match="fork_threshold_tokens"):
        ours = from_trl_async_config(trl_cfg)
    assert (ours.rollout_mode, ours.use_vllm, ours.vllm_mode) == ("async", True, "server")
    assert (ours.max_staleness, ours.weight_sync_steps, ours.queue_maxsize) == (2, 3, 64)
    assert ours.vllm_server_base_url == "http://127.0.0.1:8011" and ours.learning_rate == 1e-5
    assert ours.importance_sampling_correction
