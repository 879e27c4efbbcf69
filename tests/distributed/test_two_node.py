"""The two-node recipe of docs/distributed.md run the way a cluster runs it, on one machine: two ``accelerate
launch`` invocations with machine ranks 0 and 1 meeting at 127.0.0.1 (gloo), against the same recipe as two
processes of one machine (``grpo-ascend train --num_processes 2``). Same losses, same final weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from distributed_runs import ROOT, base_env, free_port
from safetensors.torch import load_file

RECIPE = {
    "model": "builtin:tiny-warm", "dataset": "synthetic:arithmetic",
    "dataset_kwargs": {"n": 64, "max_operand": 10, "ops": "+-", "seed": 7},
    "reward_funcs": ["accuracy", {"name": "length_penalty", "target": 4}],  # rewards that differ within a group
    "lora_r": 4, "num_generations": 4, "per_device_train_batch_size": 8, "max_prompt_length": 96,
    "max_completion_length": 8, "length_bucket": 16, "max_steps": 3, "save_steps": 0, "learning_rate": 1e-3,
    "lr_scheduler_type": "constant", "disable_tqdm": True, "log_completions_steps": 0, "device": "cpu",
    "export_adapter_at_end": True, "seed": 0,
}
TIMEOUT = 300


def _fail(name: str, logs: list[Path], codes: list[int | None]) -> None:
    tails = "\n".join(f"--- {log.name} ---\n{log.read_text()[-3000:]}" for log in logs)
    pytest.fail(f"{name} exited with {codes}\n{tails}")


def two_machines(recipe: Path, out: Path, logs: Path) -> None:
    """Machine ranks 0 and 1, one process each, as ``accelerate launch`` runs on each node of a cluster."""
    port = str(free_port())
    procs, files = [], []
    for machine in (0, 1):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
                   "--machine_rank", str(machine), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                   "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "-m", "grpo_ascend.cli", "--log-level", "warning", "train", str(recipe), "--output_dir", str(out)]
        files.append(logs / f"machine{machine}.txt")
        with open(files[-1], "w") as log:
            procs.append(subprocess.Popen(command, env=base_env(), cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        _fail("the two machine ranks", files, codes)


def one_machine(recipe: Path, out: Path, logs: Path) -> None:
    """The same recipe as two processes of one machine."""
    command = [sys.executable, "-m", "grpo_ascend.cli", "--log-level", "warning", "train", str(recipe),
               "--output_dir", str(out), "--num_processes", "2"]
    log = logs / "one_machine.txt"
    with open(log, "w") as handle:
        code = subprocess.run(command, env=base_env(), cwd=str(ROOT), stdout=handle, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT).returncode
    if code != 0:
        _fail("grpo-ascend train --num_processes 2", [log], [code])


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_machine_ranks_on_localhost_train_as_two_local_processes(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    two_machines(recipe, tmp_path / "two", tmp_path)
    one_machine(recipe, tmp_path / "one", tmp_path)

    two, one = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]  # one writer (machine 0's rank 0)
    assert any(r["reward_std"] > 0 for r in one)  # the groups' rewards differ: the steps move the weights
    for a, b in zip(two, one):
        for key in ("loss", "grad_norm", "reward", "entropy", "completion_length/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    assert all(r["grad_norm"] > 0 for r in one)

    got = load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    expected = load_file(str(tmp_path / "one" / "adapter" / "adapter_model.safetensors"))
    assert got.keys() == expected.keys() and got
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=0, msg=name)
    assert any(v.abs().max() > 0 for k, v in got.items() if "lora_B" in k)  # LoRA B starts at zero: it trained
    # machine 1 joined as global rank 1 of 2, and only machine 0 wrote the run's files
    assert "world_size" in (tmp_path / "two" / "checkpoint-3" / "trainer_state.json").read_text()
    assert json.loads((tmp_path / "two" / "checkpoint-3" / "trainer_state.json").read_text())["world_size"] == 2
