"""Tool calling with environments under 2 processes (gloo on the CPU): every rank runs its own
rollouts' tools, the tool metrics are summed over ranks and the ranks end with identical weights;
an evaluation afterwards (uneven slices) gives both ranks the same metrics."""

from __future__ import annotations

import json

import torch
from distributed_runs import SUPPORT, launch

WORKER = SUPPORT / "multiturn_dist_worker.py"


def test_tool_training_under_two_processes(tmp_path, tiny_model_dir):
    out = tmp_path / "dist"
    launch("tools", out, {"model_dir": str(tiny_model_dir)}, worker=WORKER)
    lines = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "loss" in r]
    assert len(records) == 2 and len(lines) == 3  # the evaluation's record is written once
    for r in records:
        # 2 ranks × 1 prompt × 4 generations, one call each, every environment rewarded.
        assert r["tools/calls"] == 8 and r["tools/completions"] == 8 and r["tools/calls_per_completion"] == 1.0
        assert r["rewards/AddEnv/mean"] == 1.0 and r["tools/failed_calls"] == 0
    w0, w1 = (torch.load(out / f"weights_rank{r}.pt") for r in (0, 1))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    # evaluate() after training: the ranks' tool rollouts (2 prompts and 1) give the same summed metrics.
    e0, e1 = (json.loads((out / f"eval_rank{r}.json").read_text()) for r in (0, 1))
    e0.pop("eval/runtime"), e1.pop("eval/runtime")
    assert e0 == e1 and e0["eval/num_prompts"] == 3 and e0["eval/num_generations"] == 2
    assert e0["eval/tools/calls_per_completion"] == 1.0 and e0["eval/tools/failed_calls"] == 0
    assert e0["eval/rewards/AddEnv/mean"] == 1.0 and e0["eval/greedy/rewards/AddEnv/mean"] == 1.0
