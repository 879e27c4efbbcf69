"""Data-parallel training with 2 processes on the CPU (gloo over loopback), and the launch configs.

Each multi-process test starts tests/support/dist_worker.py once per rank with the environment a launcher
sets; one process per rank runs on one thread so two ranks fit the 2-core CI machine. The rank
processes are forked from a process that has already imported torch, transformers, peft and
grpo_ascend (tests/support/rank_forker.py; GRPO_TEST_FORK_RANKS=0 starts fresh interpreters instead).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import dist_worker
import pytest
import torch
import yaml
from distributed_runs import (
    ROOT,
    WORLD,
    StopHere,
    assert_resumed_run_matches,
    base_env,
    fake_accelerator,
    launch,
    launch_once_per_session,
    rank_reports,
    rank_weights,
)

ACCELERATE_CONFIGS = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_ranks_share_one_global_draw(tmp_path, tiny_model_dir, algorithm):
    """Through the real round preparation, the ranks score disjoint prompts that together are one
    process's draw, round by round (crossing an epoch boundary), and count epochs once."""
    launch("draws", tmp_path / "dist", {"model_dir": str(tiny_model_dir), "algorithm": algorithm})
    ranks = [json.loads((tmp_path / "dist" / f"draws_rank{r}.json").read_text()) for r in range(WORLD)]
    single, seen = dist_worker.recording_trainer(str(tiny_model_dir), algorithm, str(tmp_path / "one"), 1)
    single.train()
    assert len(seen) == 3 and all(len(ids) == 4 for ids in seen)
    for round_index, expected in enumerate(seen):
        mine = [r["rounds"][round_index] for r in ranks]
        assert len(mine[0]) == len(mine[1]) == 2, mine
        assert sorted(mine[0] + mine[1]) == expected, (round_index, mine, expected)
        if round_index < 2:  # within one epoch every prompt is drawn once: the ranks' prompts are disjoint
            assert not set(mine[0]) & set(mine[1]), (round_index, mine)
    epochs = [record["epoch"] for record in single.tracker.history]
    assert epochs == [0.4, 0.8, 1.2]  # 4 of 10 prompts a round; the third round crosses into the second epoch
    assert all(r["epochs"] == epochs for r in ranks)


# ---------------------------------------------------------------------------------------------
# training, files, resume
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model_dir):
    """An uninterrupted 2-process run of 4 optimizer steps (checkpoints at 2 and 4): plain data
    parallelism with the default config, also the reference of tests/distributed/test_fsdp.py (one launch for both)."""
    return launch_once_per_session(tmp_path_factory, "ddp-default", "train", {"model_dir": str(tiny_model_dir)})


def test_ranks_hold_identical_weights_after_several_steps(full_run):
    reports = rank_reports(full_run)
    assert [r["status"] for r in reports] == ["finished"] * WORLD
    assert [r["step"] for r in reports] == [4] * WORLD
    assert {r["world_size"] for r in reports} == {WORLD}
    assert {r["backend"] for r in reports} == {"gloo"}
    w0, w1 = rank_weights(full_run, 0), rank_weights(full_run, 1)
    assert w0.keys() == w1.keys() and len(w0) > 0
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
    # ... and training moved them: LoRA B starts at zero.
    assert any(v.abs().max() > 0 for k, v in w0.items() if "lora_B" in k)


def test_only_rank_zero_writes_files(full_run):
    reports = rank_reports(full_run)
    assert reports[1]["writes"] == []
    written = "\n".join(reports[0]["writes"])
    for name in ("metrics.jsonl", "samples.jsonl", "summary.json", "manifest.json"):
        assert name in written, name
    run = full_run / "run"
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]  # one writer: no duplicated records
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not list(run.glob(".tmp-*"))
    extra = run / "checkpoint-2" / "extra.safetensors"
    from safetensors.torch import load_file

    keys = set(load_file(str(extra)))
    assert {f"rank{r}/sampling_generator" for r in range(WORLD)} <= keys
    assert {f"rank{r}/rng_state" for r in range(WORLD)} <= keys
    state = json.loads((run / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["world_size"] == WORLD


def test_resume_from_a_two_process_checkpoint_is_exact(tmp_path, full_run, tiny_model_dir):
    out = tmp_path / "resumed"
    spec = {"model_dir": str(tiny_model_dir), "config": {"output_dir": str(out / "run")}}
    launch("train", out, {**spec, "stop_after_step": 2})
    assert [r["status"] for r in rank_reports(out)] == ["preempted"] * WORLD
    launch("train", out, {**spec, "resume": "latest"})
    reports = rank_reports(out)
    assert [r["status"] for r in reports] == ["finished"] * WORLD
    assert reports[1]["writes"] == []
    # The resumed ranks sample exactly what the uninterrupted ones did (each restored its own
    # generator): the sample statistics of every step match exactly ...
    # ... and so do the weights. (Runs in separate processes have been seen to differ in the last
    # bits of a loss value, so weights are compared closely rather than bit for bit.)
    assert_resumed_run_matches(full_run, out, [1, 2, 3, 4], rel=1e-4, abs_=1e-7, rtol=1e-3, atol=1e-5)


def test_per_rank_random_state_round_trips(tmp_path, tiny_model_dir):
    """Restoring the gathered states gives each rank back its own generator and RNG streams."""
    cfg = dist_worker.grads_config(str(tmp_path / "one"), 1)
    trainer = dist_worker.make_trainer(str(tiny_model_dir), cfg)
    gen_states = [torch.Generator().manual_seed(s).get_state() for s in (5, 6)]
    import io

    from grpo_ascend import device as dev

    buffers = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        buf = io.BytesIO()
        torch.save(dev.rng_state(trainer.device), buf)
        buffers.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    extra = {"sampling_generator": gen_states[0]}
    for r in range(WORLD):
        extra[f"rank{r}/sampling_generator"] = gen_states[r]
        extra[f"rank{r}/rng_state"] = buffers[r]
    trainer.checkpointer.restore_rank_random_state(extra, saved_world_size=WORLD)  # this process is rank 0
    assert torch.equal(trainer.generator.get_state(), gen_states[0])
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(123)
    trainer.checkpointer.restore_rank_random_state(extra, saved_world_size=WORLD)
    assert torch.equal(torch.rand(3), expected)
    # A single-process checkpoint (no per-rank keys) still gives rank 0 its sampling generator.
    trainer.checkpointer.restore_rank_random_state({"sampling_generator": gen_states[0]}, saved_world_size=1)
    assert torch.equal(trainer.generator.get_state(), gen_states[0])


# ---------------------------------------------------------------------------------------------
# the CLI's --num_processes convenience (accelerate launch underneath)
# ---------------------------------------------------------------------------------------------


def test_cli_num_processes_launches_data_parallel_training(tmp_path, tiny_model_dir):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(tiny_model_dir), "dataset": "synthetic:arithmetic", "dataset_kwargs": {"n": 32, "seed": 1},
        "reward_funcs": ["accuracy"], "lora_r": 4, "num_generations": 2, "per_device_train_batch_size": 4,
        "max_prompt_length": 96, "max_completion_length": 6, "length_bucket": 16, "max_steps": 2, "save_steps": 0,
        "output_dir": str(tmp_path / "run"), "disable_tqdm": True, "log_completions_steps": 0, "device": "cpu",
        "lr_scheduler_type": "constant",
    }))
    cmd = [sys.executable, "-m", "grpo_ascend.cli", "train", str(recipe), "--num_processes", str(WORLD),
           "--learning_rate", "1e-3"]
    done = subprocess.run(cmd, env=base_env(), cwd=str(ROOT), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"× {WORLD} process(es)" in done.stdout
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2]
    assert lines[0]["learning_rate"] == pytest.approx(1e-3)
    assert (tmp_path / "run" / "checkpoint-2" / "manifest.json").is_file()


def test_num_processes_inside_a_launched_process_is_refused(monkeypatch):
    from grpo_ascend.errors import ConfigError
    from grpo_ascend.run import launch_command

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="already started by a launcher with 4"):
        launch_command("recipe.yaml", [], 2)


def test_launch_command_runs_accelerate_then_the_cli(monkeypatch):
    import argparse

    from grpo_ascend import run

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cmd = run.launch_command("r.yaml", ["--max_steps", "3"], 8, log_level="warning")
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--num_processes") + 1] == "8"
    tail = cmd[cmd.index("grpo_ascend.cli") - 1 :]
    assert tail == ["-m", "grpo_ascend.cli", "--log-level", "warning", "train", "r.yaml", "--max_steps", "3"]
    # --num_processes among the overrides (either spelling) is taken out of them and starts the processes.
    launched = []
    monkeypatch.setattr(run.subprocess, "call", lambda command: launched.append(command) or 0)
    for overrides, processes, rest in ((["--max_steps", "3", "--num-processes=4", "--seed", "1"], 4,
                                        ["--max_steps", "3", "--seed", "1"]), (["--num_processes", "2"], 2, [])):
        assert run.run_train(argparse.Namespace(config="r.yaml", overrides=overrides, num_processes=None)) == 0
        assert launched.pop() == run.launch_command("r.yaml", rest, processes)


# ---------------------------------------------------------------------------------------------
# accelerate config files in recipes/accelerate
# ---------------------------------------------------------------------------------------------


def test_accelerate_configs_exist():
    names = {p.name for p in ACCELERATE_CONFIGS}
    assert {"npu_1node_8cards.yaml", "npu_2nodes_16cards.yaml", "deepspeed_zero2.yaml",
            "deepspeed_zero3.yaml", "fsdp2_1node_8cards.yaml"} <= names


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_parses_with_accelerate(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    raw = yaml.safe_load(path.read_text())
    for key in ("compute_environment", "distributed_type", "num_machines", "num_processes", "machine_rank",
                "mixed_precision", "main_training_function"):
        assert key in raw, f"{path.name} lacks {key}"
    config = ClusterConfig.from_yaml_file(str(path))  # rejects unknown keys, converts enums
    assert config.compute_environment == ComputeEnvironment.LOCAL_MACHINE
    assert config.num_processes >= 1 and config.num_machines >= 1
    assert config.num_processes % config.num_machines == 0, "processes must split evenly over machines"
    assert 0 <= config.machine_rank < config.num_machines
    assert config.mixed_precision in ("no", "bf16", "fp16")
    if config.num_machines > 1:
        assert config.main_process_ip and config.main_process_port, "multi-node needs the main process address"
    if config.distributed_type == DistributedType.DEEPSPEED:
        ds = config.deepspeed_config
        assert ds.get("zero_stage") in (2, 3)
        assert "deepspeed_multinode_launcher" in ds or config.num_machines == 1
    elif config.distributed_type == DistributedType.FSDP:
        assert config.fsdp_config.get("fsdp_version") == 2  # grpo-ascend refuses FSDP1
        assert not config.fsdp_config.get("fsdp_activation_checkpointing")
    else:
        assert config.distributed_type in (DistributedType.MULTI_NPU, DistributedType.MULTI_GPU)
        assert config.num_processes >= 2

    # What `accelerate launch --config_file PATH -m grpo_ascend.cli train RECIPE` resolves to.
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parsed = launch_command_parser().parse_args(["--config_file", str(path), "-m", "grpo_ascend.cli", "train", "r.yaml"])
    launch_args, _, _ = _validate_launch_command(parsed)
    assert launch_args.num_processes == config.num_processes
    assert launch_args.num_machines == config.num_machines
    assert launch_args.use_deepspeed == (config.distributed_type == DistributedType.DEEPSPEED)
    assert launch_args.use_fsdp == (config.distributed_type == DistributedType.FSDP)
    assert launch_args.multi_gpu == (config.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP))
    assert launch_args.training_script == "grpo_ascend.cli" and launch_args.module


# ---------------------------------------------------------------------------------------------
# what the trainer asks of accelerate
# ---------------------------------------------------------------------------------------------


def test_process_group_gets_the_device_backend_and_ddp_timeout(monkeypatch, tmp_path, tiny_model_dir):
    from datetime import timedelta

    from grpo_ascend import device as dev

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    seen: dict[str, Any] = {}
    fake_accelerator(monkeypatch, seen=seen)
    cfg = dist_worker.grads_config(str(tmp_path / "run"), 1).replace(ddp_timeout=123, device="cpu")
    with pytest.raises(StopHere):
        dist_worker.make_trainer(str(tiny_model_dir), cfg)
    (group,) = seen["kwargs_handlers"]
    assert group.backend == dev.dist_backend("cpu") == "gloo"
    assert group.timeout == timedelta(seconds=123)
    assert seen["cpu"] is True

    # A single process must not name a backend (accelerate would then expect a process group).
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("WORLD_SIZE", "1")
    seen.clear()
    with pytest.raises(StopHere):
        dist_worker.make_trainer(str(tiny_model_dir), cfg)
    assert "backend" not in seen["kwargs_handlers"][0].to_kwargs()
    assert seen["kwargs_handlers"][0].timeout == timedelta(seconds=123)
