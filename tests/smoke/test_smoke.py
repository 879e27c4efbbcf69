"""``grpo-ascend smoke`` on the CPU: the report's numbers and keys, and how checks fail, skip and time out."""

from __future__ import annotations

import importlib.util
import json
import math
import time

import fake_device
import pytest
import torch

from grpo_ascend import cli
from grpo_ascend.smoke import cli as smoke_cli
from grpo_ascend.smoke.context import SmokeContext
from grpo_ascend.smoke.report import CheckResult, markdown


@pytest.fixture()
def cpu_only(monkeypatch):
    fake_device.cpu_only(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_smoke_on_the_cpu_writes_a_report_with_the_numbers(cpu_only, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "smoke"
    assert cli.main(["--log-level", "warning", "smoke", "--model", str(tiny_model_dir), "--out", str(out),
                     "--new-tokens", "16"]) == 0
    printed = capsys.readouterr().out
    assert "| check | status | result | seconds |" in printed and "smoke_report.json" in printed
    report = json.loads((out / "smoke_report.json").read_text())
    assert set(report) == {"header", "doctor", "checks", "ok"} and report["ok"] is True
    assert report["doctor"]["device_type"] == "cpu"
    assert report["header"]["torch_npu stack"] == "n/a (torch_npu is not installed)"
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == list(smoke_cli.CHECKS)
    assert all(set(c) == {"name", "status", "summary", "numbers", "reason", "seconds"} for c in checks.values())

    rollout = checks["rollout"]["numbers"]
    assert checks["rollout"]["status"] == "ok" and rollout["greedy_equal"] is True
    assert rollout["greedy_tokens_compared"] >= 4 and rollout["dtype"] == "float32"
    assert rollout["engine_tokens_per_s"] > 0 and rollout["generate_tokens_per_s"] > 0
    assert rollout["tokens"] == 4 * 8 * 16

    for name, model in (("train_builtin", "builtin:tiny-warm"), ("train_model", str(tiny_model_dir))):
        numbers = checks[name]["numbers"]
        assert checks[name]["status"] == "ok", checks[name]
        assert numbers["model"] == model and numbers["steps"] == 5
        assert len(numbers["losses"]) == 5 and all(math.isfinite(x) for x in numbers["losses"])
        assert len(numbers["rewards"]) == 5 and all(0 <= r <= 1.1 for r in numbers["rewards"])
        assert numbers["median_step_s"] > 0 and numbers["peak_memory_gib"] > 0 and numbers["planned_peak_gib"] > 0
        assert (out / name / "metrics.jsonl").is_file()

    assert checks["ddp"]["status"] == "skipped" and "1 cpu device" in checks["ddp"]["summary"]
    transfer = checks["transfer"]["numbers"]
    assert checks["transfer"]["status"] == "ok" and transfer["bit_for_bit"] is True
    assert transfer["backend"] == "gloo" and transfer["bytes"] == 64 * 2**20 and transfer["receiver_exit_code"] == 0
    assert transfer["bytes_per_s"] == pytest.approx(2 * transfer["bytes"] / transfer["round_trip_s"])
    if importlib.util.find_spec("vllm") is None:
        assert checks["vllm"]["status"] == "skipped" and checks["vllm"]["summary"] == "vLLM is not installed"
    md = (out / "smoke_report.md").read_text()
    assert md.startswith("# grpo-ascend smoke report") and md.count("\n| ") == 1 + len(smoke_cli.CHECKS)


def test_transfer_round_trip_returns_the_bucket_and_says_where_it_ran():
    from grpo_ascend.smoke.transfer_check import loopback_devices, round_trip

    numbers = round_trip("cpu", "cpu", nbytes=3 * 2**20 + 5)
    assert numbers["bit_for_bit"] is True and numbers["receiver_exit_code"] == 0 and numbers["bytes_per_s"] > 0
    assert loopback_devices(torch.device("cpu"))[:2] == ("cpu", "cpu")


def test_the_server_transfer_check_is_skipped_without_a_server_and_names_one_that_cannot_join(tmp_path):
    from grpo_ascend.smoke.transfer_check import check_server_transfer

    ctx = SmokeContext(device=torch.device("cpu"), dtype="float32", out=tmp_path, model=None)
    assert check_server_transfer(ctx).status == "skipped"
    ctx.servers = ["http://127.0.0.1:9"]  # nothing listens there
    [result] = [r for r in smoke_cli.run_checks(ctx, skip=set(smoke_cli.CHECKS) - {"transfer_server"})
                if r.name == "transfer_server"]
    assert result.status == "failed" and "\n" not in result.reason, result.reason
    assert "http://127.0.0.1:9" in result.reason and "grpo_ascend.rollout.vllm.serve" in result.reason, result.reason


def test_a_raising_check_fails_alone_and_the_budget_skips_the_rest(monkeypatch, tmp_path):
    def broken(ctx):
        raise RuntimeError("aclnnFoo failed\nstack trace")

    def slow(ctx):
        ctx.deadline = time.monotonic() - 1
        return CheckResult("slow", "ok", "took the budget")

    monkeypatch.setattr(smoke_cli, "CHECKS", {"broken": broken, "slow": slow, "late": slow})
    ctx = SmokeContext(device=torch.device("cpu"), dtype="float32", out=tmp_path, model=None)
    results = smoke_cli.run_checks(ctx)
    assert [(r.name, r.status) for r in results] == [("broken", "failed"), ("slow", "ok"), ("late", "skipped")]
    assert results[0].reason == "RuntimeError: aclnnFoo failed"
    assert results[2].reason == "the --budget was spent"
    assert "| broken | failed | raised (RuntimeError: aclnnFoo failed) |" in markdown(results, {})


def test_bad_arguments_exit_2_with_one_line(cpu_only, capsys, tmp_path):
    assert cli.main(["smoke", "--skip", "rollot", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--skip 'rollot' is not a check (did you mean 'rollout'?)" in err[0]
    assert cli.main(["smoke", "--steps", "0", "--out", str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="check status must be one of"):
        CheckResult("x", "passed", "")
