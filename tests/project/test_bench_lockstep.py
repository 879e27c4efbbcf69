"""bench_trainer's step-interleaved runs: the two workers' timed steps alternate and never overlap."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_trainer  # noqa: E402

FAKE_WORKER = f"""
import json, sys, time
sys.path.insert(0, {str(BENCH)!r})
from bench_trainer import StepClock
impl, out, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
if impl == "trl" and total < 0:
    raise SystemExit("a worker that fails at set-up")
clock = StepClock(abs(total))
clock.begin()
for _ in range(abs(total)):
    time.sleep(0.03)
    clock.step_end()
time.sleep(0.05)  # wind-down after the last step: must overlap no step of the other worker
json.dump({{"starts": clock.starts, "ends": clock.ends, "done": time.perf_counter()}}, open(out, "w"))
"""


def _fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, total: int) -> None:
    fake_script = tmp_path / "worker.py"
    fake_script.write_text(FAKE_WORKER)

    def worker(impl, s, python, log_dir, index, mmap_threshold, script=None):  # type: ignore[no-untyped-def]
        out = log_dir / f"{impl}.json"
        return bench_trainer.Worker(impl, [sys.executable, str(fake_script), impl, str(out), str(total)], {},
                                    out, log_dir / f"{impl}.log")

    monkeypatch.setattr(bench_trainer, "make_worker", worker)


def test_steps_alternate_and_a_finished_worker_winds_down_alone(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, total=3)
    results = bench_trainer.spawn_lockstep(bench_trainer.Settings(warmup_steps=1, steps=2), sys.executable,
                                           tmp_path, 0)
    spans = sorted((start, end, impl) for impl, r in results.items() for start, end in zip(r["starts"], r["ends"]))
    assert [impl for _, _, impl in spans] == ["ours", "trl"] * 3
    for (_, end, _), (start, _, _) in zip(spans, spans[1:]):
        assert end <= start  # one worker's step ends before the other's begins
    assert results["ours"]["done"] <= results["trl"]["starts"][-1]
    clock = bench_trainer.StepClock(2)
    clock.starts, clock.ends = [0.0, 5.0], [4.0, 6.5]
    clock.cpu_starts, clock.cpu_ends = [0.0, 3.0], [2.0, 3.5]
    assert clock.steps(warmup=1) == (4.0, [1.5], [0.5])  # a step is its own turn, not the gap between ends


def test_a_worker_that_fails_is_reported_with_its_log(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, total=-2)
    with pytest.raises(SystemExit, match=r"trl worker failed \(exit 1\)(.|\n)*a worker that fails at set-up"):
        bench_trainer.spawn_lockstep(bench_trainer.Settings(), sys.executable, tmp_path, 0)
