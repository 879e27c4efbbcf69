"""Tool calling with environments under 2 processes (gloo on the CPU): every rank runs its own
rollouts' tools, the tool metrics are summed over ranks and the ranks end with identical weights."""

from __future__ import annotations

import json
from pathlib import Path

import test_distributed
import torch

WORKER = Path(__file__).resolve().parent / "multiturn_dist_worker.py"


def test_tool_training_under_two_processes(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(test_distributed, "WORKER", WORKER)
    out = tmp_path / "dist"
    test_distributed.launch("tools", out, {"model_dir": str(tiny_model_dir)})
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        # 2 ranks × 1 prompt × 4 generations, one call each, every environment rewarded.
        assert r["tools/calls"] == 8 and r["tools/completions"] == 8 and r["tools/calls_per_completion"] == 1.0
        assert r["rewards/AddEnv/mean"] == 1.0 and r["tools/failed_calls"] == 0
    w0, w1 = (torch.load(out / f"weights_rank{r}.pt") for r in (0, 1))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
