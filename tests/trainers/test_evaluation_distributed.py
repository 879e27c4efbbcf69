"""Evaluation under 2 processes (gloo on the CPU), in one launch (tests/support/eval_dist_worker.py):

- the metrics (pass@k and mean@k included) equal one process's on the same weights and eval set,
  with the eval prompts split unevenly over the ranks (3 and 2; after training a one-prompt set,
  where rank 1 has none);
- both ranks hold the same metrics and the same best checkpoint; only rank 0 writes, once per
  evaluation, and best.json names the best evaluated checkpoint;
- a run with evaluation trains exactly like the same run without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import eval_dist_worker
import pytest
import torch
from distributed_runs import SUPPORT, WORLD, launch

from grpo_ascend.data.synthetic import arithmetic_dataset


def _same_metrics(got: dict[str, float], expected: dict[str, float], where: str) -> None:
    keys = set(expected) - {"eval/runtime"}
    assert keys and keys <= set(got), where
    assert any(k.startswith("eval/pass@") for k in keys) and any(k.startswith("eval/mean@") for k in keys)
    for key in sorted(keys):
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-7, nan_ok=True), (where, key)


def _train_records(path: Path) -> list[dict]:
    drop = ("time/", "memory/", "tokens_per_second", "eval/")
    return [{k: v for k, v in r.items() if not k.startswith(drop)}
            for r in map(json.loads, open(path)) if "reward" in r]


@pytest.mark.slow
def test_evaluation_under_two_processes(tmp_path, tiny_model_dir):
    out = tmp_path / "dist"
    launch("evaluate", out, {"model_dir": str(tiny_model_dir)}, worker=SUPPORT / "eval_dist_worker.py")
    ranks = [torch.load(out / f"eval_rank{r}.pt", weights_only=False) for r in range(WORLD)]

    # Both ranks report the same (reduced) metrics, at the same steps, and agree on the best.
    evaluations = ranks[0]["evaluations"]
    assert [e["step"] for e in evaluations] == [0, 2, 4]
    for got in ranks[1:]:
        assert [e["step"] for e in got["evaluations"]] == [0, 2, 4]
        for a, b in zip(evaluations, got["evaluations"]):
            assert {k: v for k, v in a.items() if k != "eval/runtime"} == {k: v for k, v in b.items() if k != "eval/runtime"}
        assert got["best"] == ranks[0]["best"]
    assert all(e["eval/num_prompts"] == eval_dist_worker.EVAL_SIZE for e in evaluations)
    assert ranks[0]["small"]["eval/num_prompts"] == 1

    # One process, same weights, same eval sets: the same numbers.
    single = eval_dist_worker.eval_trainer(str(tiny_model_dir), eval_dist_worker.eval_config(str(tmp_path / "one")))
    _same_metrics(evaluations[0], single.evaluate(), "step 0")
    with torch.no_grad():
        params = dict(single.policy.named_parameters())
        for name, value in ranks[0]["weights_evaluated"].items():
            params[name].copy_(value)
    _same_metrics(evaluations[-1], single.evaluate(), "step 4")
    _same_metrics(ranks[0]["small"], single.evaluate(arithmetic_dataset(1, seed=eval_dist_worker.SMALL_SEED)),
                  "one prompt")

    # Only rank 0 writes; metrics.jsonl holds each evaluation once; best.json names the best of them.
    assert ranks[1]["writes"] == []
    run = out / "run"
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    logged = [r for r in lines if "eval/reward" in r]
    assert [(r["step"], r["eval/num_prompts"]) for r in logged] == [(0, 5), (2, 5), (4, 5), (4, 1)]  # + evaluate()
    logged = logged[:3]
    assert [r["eval/reward"] for r in logged] == [e["eval/reward"] for e in evaluations]
    saved = [e for e in evaluations if e["step"] > 0]  # step 0 has no checkpoint to point at
    best = max(saved, key=lambda e: (e["eval/reward"], -e["step"]))  # ties keep the earlier
    record = json.loads((run / "best.json").read_text())
    assert record == {"checkpoint": f"checkpoint-{best['step']}", "step": best["step"], "metric": "eval/reward",
                      "value": best["eval/reward"]}
    assert ranks[0]["best"] == (best["step"], best["eval/reward"])
    assert (run / "best").resolve() == (run / record["checkpoint"]).resolve()

    # Evaluation did not change training: same weights (bit for bit) and training records.
    for r, got in enumerate(ranks):
        assert got["weights_evaluated"].keys() == got["weights_plain"].keys()
        for name, value in got["weights_plain"].items():
            assert torch.equal(got["weights_evaluated"][name], value), (r, name)
    assert _train_records(run / "metrics.jsonl") == _train_records(out / "run_plain" / "metrics.jsonl")
    assert len(_train_records(run / "metrics.jsonl")) == 4
