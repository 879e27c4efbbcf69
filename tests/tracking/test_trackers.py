"""report_to trackers, each with its real package in its offline/local mode: the config, scalar
metrics and a table of sample completions reach the tracker's own files; clear errors otherwise."""

from __future__ import annotations

import glob
import json
import sqlite3
import struct
from pathlib import Path

import pytest

import grpo_ascend.tracking.trackers as trackers
from grpo_ascend.config.configs import GRPOConfig
from grpo_ascend.errors import ConfigError
from grpo_ascend.tracking.run_tracker import RunTracker

CONFIG = {"beta": 0.04, "loss_type": "sapo", "report_to": ["jsonl"]}
ROWS = [{"prompt": "What is 1+1?", "completion": "<answer>2</answer>", "reward": 1.0},
        {"prompt": "What is 2+2?", "completion": "<answer>5</answer>", "reward": 0.0}]


def run_tracker(out: Path, name: str) -> None:
    tracker = RunTracker(out, 2, report_to=[name], config=CONFIG, disable_tqdm=True)
    tracker.log(1, {"reward": 0.25, "loss": 1.5, "note": "text is not a scalar"})
    tracker.log(2, {"reward": 0.75, "loss": 1.25})
    tracker.log_samples(2, ROWS)
    tracker.close()


def needs(package: str):
    return pytest.mark.skipif(trackers.importlib.util.find_spec(package) is None,
                              reason=f"needs {package} (extra: {package})")


def test_jsonl(tmp_path):
    run_tracker(tmp_path, "jsonl")
    assert json.loads((tmp_path / "run_config.json").read_text()) == CONFIG
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["reward"]) for m in metrics] == [(1, 0.25), (2, 0.75)]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 2, **row} for row in ROWS]


@needs("tensorboard")
def test_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_tracker(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.75)]
    assert "note" not in events.Tags()["scalars"]
    text = {t: events.Tensors(t)[0].tensor_proto.string_val[0].decode() for t in ("config/text_summary",
                                                                                  "samples/text_summary")}
    assert '"loss_type": "sapo"' in text["config/text_summary"]
    assert "| prompt | completion | reward |" in text["samples/text_summary"]
    assert "<answer>5</answer>" in text["samples/text_summary"]


@needs("wandb")
def test_wandb_offline(tmp_path, monkeypatch):
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "cfg",
                       "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(key, str(value))
    run_tracker(tmp_path, "wandb")
    import wandb

    wandb.teardown()  # finish() can return before wandb's service process has flushed the run file
    run_dir = Path(glob.glob(str(tmp_path / "wandb" / "offline-run-*"))[0])
    table = json.loads(next((run_dir / "files" / "media" / "table").glob("samples_2_*.table.json")).read_text())
    assert table == {"columns": ["prompt", "completion", "reward"], "data": [list(r.values()) for r in ROWS]}
    # The run file holds protobuf records (no reader ships with wandb 0.31); history and config
    # values are stored in it as JSON text.
    record = next(run_dir.glob("*.wandb")).read_bytes()
    for needle in (b"reward", b"0.25", b"0.75", b"loss_type", b'"sapo"'):
        assert needle in record, needle


@needs("swanlab")
def test_swanlab_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    run_tracker(tmp_path, "swanlab")
    run_dir = Path(glob.glob(str(tmp_path / "swanlog" / "run-*"))[0])
    config = (run_dir / "files" / "config.yaml").read_text()
    assert "loss_type:" in config and "value: sapo" in config
    table = json.loads(next((run_dir / "media" / "echarts").glob("*.json")).read_text())
    assert table["rowData"] == ROWS
    record = next(run_dir.glob("*.swanlab")).read_bytes()  # protobuf records: scalars as doubles
    assert b"reward" in record and struct.pack("<d", 0.25) in record and struct.pack("<d", 0.75) in record


@needs("trackio")
def test_trackio_local(tmp_path, monkeypatch):
    monkeypatch.setattr("trackio.TRACKIO_DIR", tmp_path / "trackio", raising=False)
    monkeypatch.setattr("trackio.utils.TRACKIO_DIR", tmp_path / "trackio", raising=False)
    monkeypatch.setattr("trackio.sqlite_storage.TRACKIO_DIR", tmp_path / "trackio", raising=False)
    run_tracker(tmp_path, "trackio")
    db = sqlite3.connect(next((tmp_path / "trackio").glob("*.db")))
    rows = [(step, json.loads(m)) for step, m in db.execute("select step, metrics from metrics order by id")]
    assert (1, {"reward": 0.25, "loss": 1.5}) in rows and (2, {"reward": 0.75, "loss": 1.25}) in rows
    table = next(m["samples"] for _, m in rows if "samples" in m)
    assert table["_type"] == "trackio.table" and table["_value"] == ROWS
    config = json.loads(db.execute("select config from configs").fetchone()[0])
    assert config["loss_type"] == "sapo" and config["beta"] == 0.04


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda n: None if n == "swanlab" else real(n))
    with pytest.raises(ConfigError, match=r"'swanlab' but the swanlab package is not installed: pip install 'grpo-ascend\[swanlab\]'"):
        RunTracker(tmp_path, 1, report_to=["swanlab"], disable_tqdm=True)


def test_unknown_names_are_refused():
    with pytest.raises(ConfigError, match=r"unknown tracker 'wandbb' \(did you mean 'wandb'\?\); valid: jsonl, tensorboard"):
        GRPOConfig(report_to=["wandbb"])
    assert trackers.check_report_to(["none", "jsonl", "jsonl"]) == ["jsonl"]
    # TRL style: one name, "none", "all" (every installed tracker).
    assert GRPOConfig(report_to="wandb").report_to == ["wandb"]
    assert GRPOConfig(report_to="none").report_to == []
    assert GRPOConfig(report_to="all").report_to == trackers.installed_trackers()
    assert "jsonl" in trackers.installed_trackers()
