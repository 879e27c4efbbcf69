"""Two-process runs for the multi-process tests: launch ranks of a worker script joined over gloo on
loopback, read what they wrote, and compare a resumed run with an uninterrupted one.

Each rank is started with the environment a launcher sets; one process per rank runs on one thread so
two ranks fit the 2-core CI machine. The ranks are forked from a process that has already imported torch,
transformers, peft and grpo_ascend (rank_forker.py; ``GRPO_TEST_FORK_RANKS=0`` starts fresh interpreters
instead). The default worker is dist_worker.py; a test with its own worker script passes ``worker=``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rank_forker import RankForker

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
WORKER = SUPPORT / "dist_worker.py"
WORLD = 2
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
# Per-step metrics that depend only on what was sampled (equal when a resumed run samples the same).
SAMPLED = ("reward", "reward_std", "completion_length/mean", "completion_length/min", "completion_length/max",
           "advantages/mean", "advantages/abs_max", "tokens_generated")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    """This process's environment without a launcher's strategy switches, one thread per process."""
    env = dict(os.environ)
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def launch(mode: str, out: Path, spec: dict[str, Any], timeout: float = 240,
           extra_env: dict[str, str] | None = None, worker: Path = WORKER) -> None:
    """Run ``WORLD`` ranks of ``worker`` in ``mode`` joined over loopback; fail with their logs if any fails."""
    run_ranks([str(worker), mode, str(out), json.dumps(spec)], out, f"log_{mode}", timeout, extra_env)


def run_ranks(argv: list[str], out: Path, log_name: str, timeout: float = 240,
              extra_env: dict[str, str] | None = None) -> None:
    """Run ``WORLD`` ranks of the script ``argv`` (forked, see rank_forker.py) with a launcher's
    environment, each logging to ``out/<log_name>_rank<r>.txt``; fail with the logs if any rank fails."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**base_env(), **(extra_env or {})}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD),
               LOCAL_WORLD_SIZE=str(WORLD))
    procs, logs = [], []
    forker = RankForker.shared()
    for rank in range(WORLD):
        log_path = out / f"{log_name}_rank{rank}.txt"
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        if forker is not None:
            procs.append(forker.start(argv, rank_env, str(ROOT), str(log_path)))
            continue
        log = open(log_path, "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=str(ROOT)))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if codes != [0] * WORLD:
        tails = "\n".join(f"--- rank {r} ---\n" + (out / f"{log_name}_rank{r}.txt").read_text()[-3000:]
                          for r in range(WORLD))
        pytest.fail(f"{Path(argv[0]).name} ranks exited with {codes or 'a timeout'}\n{tails}")


def rank_reports(out: Path) -> list[dict[str, Any]]:
    """Every rank's ``report_rank<r>.json``."""
    return [json.loads((out / f"report_rank{r}.json").read_text()) for r in range(WORLD)]


def rank_weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s saved trainable weights."""
    return torch.load(out / f"weights_rank{rank}.pt", weights_only=True)


def stable_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl without the ones that depend on timing or memory."""
    skip = ("time/", "tokens_per_second", "memory/")
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(skip)} for line in open(path)]


def assert_resumed_run_matches(full: Path, resumed: Path, steps: list[int], rel: float, abs_: float,
                               rtol: float, atol: float, sampled: tuple[str, ...] = SAMPLED) -> None:
    """A resumed run's steps equal the uninterrupted run's: ``sampled`` metrics exactly, the loss
    statistics to (rel, abs_), every rank's final trainable weights to (rtol, atol); zeros = exact."""
    by_step = {r["step"]: r for r in stable_metrics(full / "run" / "metrics.jsonl")}
    got_metrics = stable_metrics(resumed / "run" / "metrics.jsonl")
    assert [r["step"] for r in got_metrics] == steps
    for b in got_metrics:
        a = by_step[b["step"]]
        assert {k: a[k] for k in sampled} == {k: b[k] for k in sampled}, a["step"]
        for key in ("loss", "grad_norm", "kl", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=rel, abs=abs_), (a["step"], key)
    expected = rank_weights(full, 0)
    for rank in range(WORLD):
        got = rank_weights(resumed, rank)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol, msg=f"rank {rank}, {name}")


def launch_once_per_session(tmp_path_factory, name: str, mode: str, spec: dict[str, Any]) -> Path:
    """The folder of a launch made once per test session, shared by every test file (and every
    pytest-xdist worker, behind a file lock) that compares against it; ``spec``'s config gets
    ``output_dir`` = ``<folder>/run``. Only for launches no test writes into."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    out = root / f"shared-{name}"
    with FileLock(str(out) + ".lock"):
        if not (out / "launched").exists():
            shutil.rmtree(out, ignore_errors=True)
            launch(mode, out, {**spec, "config": {**spec.get("config", {}), "output_dir": str(out / "run")}})
            (out / "launched").touch()
    return out


# ---------------------------------------------------------------------------------------------
# what the trainer asks of accelerate
# ---------------------------------------------------------------------------------------------


class StopHere(Exception):
    """Raised by :func:`fake_accelerator`'s recording accelerator once it has seen its arguments."""


def fake_accelerator(monkeypatch, distributed_type=None, seen=None, zero_stage: int | None = None):
    """Replace accelerate.Accelerator: record its arguments, then stop (:class:`StopHere`) or pretend a
    distributed type (with ``zero_stage``: DeepSpeed at that ZeRO stage)."""
    import accelerate
    from accelerate.utils import DistributedType

    class FakeAccelerator:
        def __init__(self, **kwargs: Any):
            if seen is not None:
                seen.update(kwargs)
                raise StopHere
            self.device = torch.device("cpu")
            self.num_processes = 1
            self.distributed_type = distributed_type or DistributedType.NO
            if zero_stage is not None:
                self.distributed_type = DistributedType.DEEPSPEED
                self.state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage))

    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)


# ---------------------------------------------------------------------------------------------
# launch environments of the strategies (what `accelerate launch --config_file ...` sets)
# ---------------------------------------------------------------------------------------------

ZERO2_ENV = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}


def zero3_env(folder: Path) -> dict[str, str]:
    """The launch environment of ZeRO-3 with every parameter partitioned (none kept whole as 'persistent')."""
    config = folder / "ds_zero3.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)}
