"""DeepSpeed ZeRO-2 and ZeRO-3 behind accelerate: 2 processes on the CPU (gloo), and the refusals around it.

The multi-process tests start tests/support/dist_worker.py once per rank with the environment
``accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml`` sets
(ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE); they need ``pip install deepspeed``
and are skipped without it. DeepSpeed picks its CPU accelerator when no device is present.
ZeRO-3 runs from a DeepSpeed config file (ACCELERATE_DEEPSPEED_CONFIG_FILE) whose
``stage3_param_persistence_threshold`` is 0, so every parameter of the tiny model (the LoRA
matrices included) really is partitioned; the model is built under ``zero.Init`` as with
``zero3_init_flag: true``.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import dist_worker
import pytest
import torch
from distributed_runs import (
    WORLD,
    ZERO2_ENV,
    StopHere,
    assert_resumed_run_matches,
    fake_accelerator,
    launch,
    rank_reports,
    rank_weights,
    stable_metrics,
    zero3_env,
)

# Adam's update lr·m/(√v+ε) turns a rounding-level difference in a near-zero gradient element into
# an update difference of up to lr·δ/ε; the ZeRO stages reduce gradients in different orders, so
# with ε=1e-8 a few of the ~50k LoRA elements end ~1e-4 apart after 4 steps while the metrics agree to
# 1e-6. ε=1e-4 keeps the runs' elementwise comparison meaningful at 1e-5 (measured: 2e-7 apart).
RUN_CONFIG = {"adam_epsilon": 1e-4}
SHARD_DIR = "optimizer_shards"


def _need_deepspeed() -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'grpo-ascend[deepspeed]')")


# ---------------------------------------------------------------------------------------------
# two processes under ZeRO-2 (slow: DeepSpeed start-up is ~10 s per launch here)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory, tiny_model_dir):
    """An uninterrupted 2-process ZeRO-2 run of 4 optimizer steps (checkpoints at 2 and 4)."""
    _need_deepspeed()
    out = tmp_path_factory.mktemp("zero2")
    launch("train", out, {"model_dir": str(tiny_model_dir), "config": {**RUN_CONFIG, "output_dir": str(out / "run")}},
           extra_env=ZERO2_ENV)
    return out


@pytest.mark.slow
def test_zero2_training_matches_plain_data_parallel(zero2_run, tmp_path, tiny_model_dir):
    """Same seed, same config: ZeRO-2 ends with the weights (and per-step metrics) of the DDP path."""
    ddp = tmp_path / "ddp"
    launch("train", ddp, {"model_dir": str(tiny_model_dir), "config": {**RUN_CONFIG, "output_dir": str(ddp / "run")}})
    reports = rank_reports(zero2_run)
    assert [r["status"] for r in reports] == ["finished"] * WORLD
    assert [r["step"] for r in reports] == [4] * WORLD
    expected = rank_weights(ddp, 0)
    for rank in range(WORLD):
        got = rank_weights(zero2_run, rank)
        assert got.keys() == expected.keys() and len(got) > 0
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=f"rank {rank}, {name}")
    assert any(v.abs().max() > 0 for k, v in expected.items() if "lora_B" in k)  # training moved them
    w0, w1 = rank_weights(zero2_run, 0), rank_weights(zero2_run, 1)
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name  # ZeRO-2 all-gathers the updated weights
    zero2 = stable_metrics(zero2_run / "run" / "metrics.jsonl")
    plain = stable_metrics(ddp / "run" / "metrics.jsonl")
    assert [r["step"] for r in zero2] == [1, 2, 3, 4]
    assert any(r["grad_norm"] > 1.0 for r in plain)  # max_grad_norm=1 clipped some step (DeepSpeed's clip)
    for a, b in zip(plain, zero2):
        assert b["reward"] == a["reward"], a["step"]
        for key in ("loss", "grad_norm", "kl", "learning_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (a["step"], key)
        assert b["skipped_steps"] == 0


@pytest.mark.slow
def test_zero2_checkpoints_are_sharded_and_only_rank_zero_writes_the_rest(zero2_run):
    run = zero2_run / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not list(run.glob(".tmp-*"))
    ckpt = run / "checkpoint-2"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["optimizer_shards"] == WORLD
    assert {f"{SHARD_DIR}/rank{r}.pt" for r in range(WORLD)} <= set(manifest["files"])
    assert not (ckpt / "optimizer.pt").exists()
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    reports = rank_reports(zero2_run)
    written = "\n".join(reports[0]["writes"])
    for name in ("metrics.jsonl", "summary.json", "manifest.json", f"{SHARD_DIR}/rank0.pt"):
        assert name in written, name
    # Rank 1 writes nothing but its optimizer shard, inside the main rank's staging folder.
    assert reports[1]["writes"], "rank 1 wrote no optimizer shard"
    for entry in reports[1]["writes"]:
        assert "/.tmp-checkpoint-" in entry and f"/{SHARD_DIR}" in entry, entry
        assert entry.endswith((SHARD_DIR, f"{SHARD_DIR}/rank1.pt")), entry


@pytest.mark.slow
def test_zero2_resume_is_exact(tmp_path, zero2_run, tiny_model_dir):
    out = tmp_path / "resumed"
    spec = {"model_dir": str(tiny_model_dir), "config": {**RUN_CONFIG, "output_dir": str(out / "run")}}
    launch("train", out, {**spec, "stop_after_step": 2}, extra_env=ZERO2_ENV)
    assert [r["status"] for r in rank_reports(out)] == ["preempted"] * WORLD
    launch("train", out, {**spec, "resume": "latest"}, extra_env=ZERO2_ENV)
    assert [r["status"] for r in rank_reports(out)] == ["finished"] * WORLD
    # Adam's moments after steps 1-2 shape steps 3-4: a lost shard would show in the weights.
    assert_resumed_run_matches(zero2_run, out, [1, 2, 3, 4], rel=1e-5, abs_=1e-8, rtol=1e-5, atol=1e-7,
                               sampled=("reward",))


# ---------------------------------------------------------------------------------------------
# two processes under ZeRO-3 (every parameter partitioned)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, tiny_model_dir):
    """An uninterrupted 2-process ZeRO-3 run of 4 optimizer steps (checkpoints at 2 and 4, adapter exported)."""
    _need_deepspeed()
    out = tmp_path_factory.mktemp("zero3")
    config = {**RUN_CONFIG, "output_dir": str(out / "run"), "export_adapter_at_end": True}
    launch("train", out, {"model_dir": str(tiny_model_dir), "config": config}, extra_env=zero3_env(out))
    return out


@pytest.mark.slow
def test_zero3_training_matches_zero2(zero3_run, zero2_run):
    """Same seed, same config: ZeRO-3 (rollouts on gathered weights, per-module gathering in training)
    ends with the weights and per-step metrics of ZeRO-2, which matches plain data parallelism."""
    reports = rank_reports(zero3_run)
    assert [r["status"] for r in reports] == ["finished"] * WORLD
    assert [r["step"] for r in reports] == [4] * WORLD
    for r in reports:  # each rank holds a slice of every parameter, the LoRA matrices included
        assert len(r["partitioned"]) == r["parameters"] and any("lora_A" in n for n in r["partitioned"]), r
    assert rank_reports(zero2_run)[0]["partitioned"] == []
    expected = rank_weights(zero2_run, 0)
    for rank in range(WORLD):
        got = rank_weights(zero3_run, rank)
        assert got.keys() == expected.keys() and len(got) > 0
        for name in expected:
            assert got[name].shape == expected[name].shape, name  # gathered whole, not a partition
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=f"rank {rank}, {name}")
    zero3 = stable_metrics(zero3_run / "run" / "metrics.jsonl")
    zero2 = stable_metrics(zero2_run / "run" / "metrics.jsonl")
    assert [r["step"] for r in zero3] == [1, 2, 3, 4]
    for a, b in zip(zero2, zero3):
        assert b["reward"] == a["reward"], a["step"]  # same rollouts: generation saw the whole weights
        for key in ("loss", "grad_norm", "kl", "entropy", "learning_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (a["step"], key)
        assert b["skipped_steps"] == 0


@pytest.mark.slow
def test_zero3_checkpoints_have_the_plain_format_and_export(zero3_run, zero2_run, tmp_path):
    """Rank 0 writes the whole adapter (gathered) in PEFT's format, every rank its optimizer shard;
    the export command works on the checkpoint unchanged."""
    from safetensors.torch import load_file

    from grpo_ascend.checkpoints.export import export_checkpoint

    run = zero3_run / "run"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    ckpt = run / "checkpoint-4"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["kind"] == "lora" and manifest["optimizer_shards"] == WORLD
    reference = zero2_run / "run" / "checkpoint-4"
    assert set(manifest["files"]) == set(json.loads((reference / "manifest.json").read_text())["files"])
    got, expected = load_file(ckpt / "adapter_model.safetensors"), load_file(reference / "adapter_model.safetensors")
    assert got.keys() == expected.keys() and len(got) > 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)
    assert json.loads((ckpt / "adapter_config.json").read_text()) == json.loads(
        (reference / "adapter_config.json").read_text())
    exported = export_checkpoint(ckpt, tmp_path / "adapter")
    assert torch.equal(load_file(exported / "adapter_model.safetensors")[next(iter(got))], got[next(iter(got))])
    live = load_file(run / "adapter" / "adapter_model.safetensors")  # export_adapter_at_end, gathered
    assert live.keys() == got.keys() and all(torch.equal(live[k], got[k]) for k in got)
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    reports = rank_reports(zero3_run)
    assert "metrics.jsonl" in "\n".join(reports[0]["writes"])
    for entry in reports[1]["writes"]:  # rank 1: its optimizer shards only
        assert "/.tmp-checkpoint-" in entry and f"/{SHARD_DIR}" in entry, entry


@pytest.mark.slow
def test_zero3_resume_is_exact(tmp_path, zero3_run, tiny_model_dir):
    """Resumed from the uninterrupted run's step-2 checkpoint (what a job preempted after that save
    leaves), a new launch replays steps 3-4 bit for bit: the adapter scattered back from rank 0's
    copy, each rank's fp32 master partition and Adam moments from its shard, every rank's RNG."""
    out = tmp_path / "resumed"
    shutil.copytree(zero3_run / "run" / "checkpoint-2", out / "run" / "checkpoint-2")
    spec = {"model_dir": str(tiny_model_dir), "config": {**RUN_CONFIG, "output_dir": str(out / "run")}}
    launch("train", out, {**spec, "resume": "latest"}, extra_env=zero3_env(tmp_path))
    assert [r["status"] for r in rank_reports(out)] == ["finished"] * WORLD
    assert_resumed_run_matches(zero3_run, out, [3, 4], rel=0, abs_=0, rtol=0, atol=0, sampled=("reward",))


# ---------------------------------------------------------------------------------------------
# what runs without DeepSpeed installed: config filling, refusals, shard files
# ---------------------------------------------------------------------------------------------


def test_zero0_is_refused_clearly(monkeypatch, tmp_path, tiny_model_dir):
    from grpo_ascend.errors import ConfigError

    fake_accelerator(monkeypatch, zero_stage=0)
    cfg = dist_worker.grads_config(str(tmp_path / "run"), 1)
    with pytest.raises(ConfigError, match="zero_stage=0 is not supported.*deepspeed_zero2.yaml"):
        dist_worker.make_trainer(str(tiny_model_dir), cfg)


def test_full_fine_tuning_under_zero3_is_refused_clearly(monkeypatch, tmp_path, tiny_model_dir):
    from grpo_ascend import GRPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.errors import ConfigError

    fake_accelerator(monkeypatch, zero_stage=3)
    cfg = dist_worker.grads_config(str(tmp_path / "run"), 1)
    with pytest.raises(ConfigError, match="full fine-tuning.*ZeRO-3.*LoRA.*deepspeed_zero2.yaml"):
        GRPOTrainer(str(tiny_model_dir), dist_worker.even_token_fraction, cfg, arithmetic_dataset(4))


def test_ppo_under_deepspeed_is_refused_clearly(monkeypatch, tmp_path, tiny_model_dir):
    from grpo_ascend import PPOConfig, PPOTrainer
    from grpo_ascend.data.synthetic import arithmetic_dataset
    from grpo_ascend.errors import ConfigError

    fake_accelerator(monkeypatch, zero_stage=2)
    cfg = PPOConfig(output_dir=str(tmp_path / "run"), max_completion_length=4, max_steps=1)
    with pytest.raises(ConfigError, match="PPOTrainer does not support DeepSpeed.*num_processes"):
        PPOTrainer(str(tiny_model_dir), dist_worker.even_token_fraction, cfg, arithmetic_dataset(4))


def test_deepspeed_launch_does_not_force_accelerate_onto_cpu_mode(monkeypatch, tmp_path, tiny_model_dir):
    """accelerate ignores its DeepSpeed settings when told cpu=True, so the trainer must not say so."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    seen: dict[str, Any] = {}
    fake_accelerator(monkeypatch, seen=seen, zero_stage=2)
    cfg = dist_worker.grads_config(str(tmp_path / "run"), 1).replace(device="cpu")
    with pytest.raises(StopHere):
        dist_worker.make_trainer(str(tiny_model_dir), cfg)
    assert seen["cpu"] is False
    assert seen["kwargs_handlers"][0].backend == "gloo"


def test_deepspeed_config_is_filled_from_the_run_config(caplog):
    from grpo_ascend.config.configs import GRPOConfig
    from grpo_ascend.distributed.deepspeed import fill_config
    from grpo_ascend.errors import ConfigError

    args = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=3, steps_per_generation=3, num_generations=2,
                      max_grad_norm=0.5)
    ds_config: dict[str, Any] = {"gradient_accumulation_steps": 1, "gradient_clipping": "auto",
                                 "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    with caplog.at_level("WARNING"):
        fill_config(ds_config, args, args.batch_plan(2), world_size=2)
    assert ds_config["train_micro_batch_size_per_gpu"] == 4
    assert ds_config["gradient_accumulation_steps"] == 3
    assert ds_config["train_batch_size"] == 4 * 3 * 2
    assert ds_config["gradient_clipping"] == 0.5
    assert "gradient_accumulation_steps=1 replaced by 3" in caplog.text
    ds_config["optimizer"] = {"type": "Adam"}
    with pytest.raises(ConfigError, match="remove them"):
        fill_config(ds_config, args, args.batch_plan(2), world_size=2)


def test_optimizer_shards_round_trip_and_refuse_another_world_size(tmp_path, tiny_model):
    from grpo_ascend.checkpoints import checkpoint as ckpt
    from grpo_ascend.checkpoints import optimizer_shards
    from grpo_ascend.errors import CheckpointError

    model, _ = tiny_model
    staging = optimizer_shards.make_staging_dir(tmp_path, 3)
    states = [{"base_optimizer_state": {"state": {}, "param_groups": []}, "part": torch.full((3,), float(r))}
              for r in range(2)]
    for r, state in enumerate(states):
        optimizer_shards.write_optimizer_shard(staging, r, state)
    path = ckpt.save_checkpoint(tmp_path, 3, ckpt.CheckpointContents(model=model, trainer_state={"step": 3}),
                                staging_dir=staging, optimizer_shards=2)
    assert not staging.exists() and path.name == "checkpoint-3"
    for r in range(2):
        assert torch.equal(optimizer_shards.load_optimizer_shard(path, r, 2)["part"], states[r]["part"])
    with pytest.raises(CheckpointError, match="shards of 2 ranks but this run has 4"):
        optimizer_shards.load_optimizer_shard(path, 0, 4)
    optimizer = torch.optim.AdamW([p for p in model.parameters()][:1])
    with pytest.raises(CheckpointError, match="sharded over 2 ranks.*ZeRO"):
        ckpt.load_checkpoint(path, model=model, optimizer=optimizer)
    # A save whose shards did not all arrive never becomes a checkpoint.
    staging = optimizer_shards.make_staging_dir(tmp_path, 4)
    optimizer_shards.write_optimizer_shard(staging, 0, states[0])
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] are missing"):
        ckpt.save_checkpoint(tmp_path, 4, ckpt.CheckpointContents(model=model, trainer_state={"step": 4}),
                             staging_dir=staging, optimizer_shards=2)
    assert not (tmp_path / "checkpoint-4").exists() and not staging.exists()
    assert ckpt.find_latest_checkpoint(tmp_path) == path
