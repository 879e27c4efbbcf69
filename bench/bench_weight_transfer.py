"""Full-weight sync to a vLLM server: over a process group (weight_transfer: collective) vs through files.

The model has Qwen2.5-0.5B's shapes, written here from its published config (hidden 896, 24 layers, 14 query /
2 key-value heads, intermediate 4,864, vocabulary 151,936, tied embeddings, rope theta 1e6, 32,768 positions:
494M parameters), with random weights from seed 0, full fine-tuning. One vLLM CPU server of it is started from our
entry point (``python -m grpo_ascend.rollout.vllm.serve``, dev mode on so that the file path's
``/collective_rpc reload_weights`` exists too). Two clients of that server take turns, ``--repeats`` times each:
the collective one (gloo over loopback on this machine) and the file one (safetensors into a folder, then the
server reloads it). Each sync is a new version, so each loads every tensor.

Also measured in the same run: this machine's memory copy bandwidth (a ``--copy-mib`` MiB torch ``copy_``, best of
3; bytes copied per second), and bytes/s of each path (the sync's tensor bytes, the policy's state dict, over its
seconds; the collective path leaves out a head tied to the embeddings, ``collective_wire_bytes`` is what it sent).

``--async-steps N`` (default 3) then measures an asynchronous run's shape on the same server: a producer thread
samples without pause (8-token completions) while the trainer thread pushes N versions, one per stand-in
optimizer step of ``--step-s`` seconds, with each path: the trainer-side push time per step, and the sampler's
stall per sync (the longest generate call that overlapped a sync, less the median call outside syncs).

``--trainer-steps N`` (0: off) then runs the real thing on the same server for each path: ``GRPOTrainer`` in
``rollout_mode: async`` (max_staleness 2, so the sampler may run two versions ahead), full fine-tuning of the same
model (AdamW, no reference model), N optimizer steps of ``--trainer-prompts`` (2) prompts x
``--trainer-generations`` (4) completions x ``--trainer-tokens`` (8) tokens (random weights over 151,936 tokens all
but never sample EOS), and reads what the trainer logged for the steps after the first (the first builds the group
and warms up): ``async/weight_push_s`` (the trainer's side of each push), ``async/sampler_weight_wait_s`` (the
seconds the sampler's requests were held for a load) and ``time/step``. On this CPU a full-fine-tuning run of this
model is bound by training in every shape tried (the defaults; 1 prompt x 2 completions x 64 tokens): the sampler
has sampled what it may ahead and is idle when a push comes, so the push shows on the trainer's side and
``--async-steps`` is the sampler-bound case.

The last line printed is one JSON object: ``collective_s``, ``files_s`` (medians), ``ratio`` (collective / files),
``bytes``, ``collective_bytes_per_s``, ``files_bytes_per_s``, ``memcpy_bytes_per_s``, and the async and trainer figures.

Examples::

    python bench/bench_weight_transfer.py                     # float32, 3 repeats
    python bench/bench_weight_transfer.py --dtype bfloat16 --repeats 5
    python bench/bench_weight_transfer.py --repeats 1 --async-steps 0 --trainer-steps 5   # the async trainer run
    python bench/bench_weight_transfer.py --repeats 1 --async-steps 0 --trainer-steps 6 --trainer-prompts 1 \
        --trainer-generations 2 --trainer-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from local_vllm_server import local_server  # noqa: E402

#: Qwen2.5-0.5B's published configuration (every field that sets a shape or the numerics).
QWEN2_5_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
                    max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu")


def build_model(dtype: torch.dtype, folder: Path) -> torch.nn.Module:
    """Qwen2.5-0.5B's shapes, random weights from seed 0, saved to ``folder`` with the built-in tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from grpo_ascend.models.tiny_model import build_tiny_model

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model("tiny"))
    config = Qwen2Config(**QWEN2_5_0_5B, torch_dtype=dtype, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def server(model_dir: Path, dtype: str, log_path: Path) -> contextlib.AbstractContextManager[str]:
    """One vLLM CPU server of ``model_dir`` from our entry point at a free local port; its URL."""
    return local_server(model_dir, log_path, dtype=dtype, max_model_len=512, kv_cache_bytes=64 * 2**20,
                        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}, start_timeout=900)


def memcpy_bytes_per_s(mib: int) -> float:
    """Bytes per second of one large ``copy_`` between two host tensors (best of 3, after a warm-up)."""
    src = torch.rand(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return src.numel() * src.element_size() / best


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def client(url: str, model_dir: Path, mode: str, sync_dir: Path):
    from transformers import AutoTokenizer

    from grpo_ascend.rollout.sampling import SamplingParams
    from grpo_ascend.rollout.vllm import VLLMServerRollout

    params = SamplingParams(num_generations=2, max_completion_length=8, temperature=1.0, max_prompt_length=None,
                            seed=None, ignore_eos=True)
    return VLLMServerRollout(url, str(model_dir), AutoTokenizer.from_pretrained(model_dir), params,
                             adapter_dir=sync_dir, start_timeout=900, sync_timeout=1800, weight_transfer=mode)


def async_run(rollout, model, first_version: int, steps: int, step_s: float) -> dict[str, float]:
    """A producer thread samples while this thread pushes ``steps`` versions (see the module docstring)."""
    from grpo_ascend.rollout.policy_weights import PolicyWeights

    calls: list[tuple[float, float]] = []
    stop = threading.Event()
    gen = torch.Generator().manual_seed(0)

    def produce() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            rollout.generate(["a short prompt"], None, gen)
            calls.append((started, time.perf_counter()))

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    time.sleep(step_s)
    syncs = []
    for step in range(steps):
        time.sleep(step_s)  # the stand-in optimizer step
        started = time.perf_counter()
        rollout.sync_weights(PolicyWeights(model, first_version + step))
        syncs.append((started, time.perf_counter()))
    time.sleep(step_s)
    stop.set()
    producer.join(600)

    def overlaps(call, window) -> bool:
        return call[0] < window[1] and call[1] > window[0]

    outside = [c[1] - c[0] for c in calls if not any(overlaps(c, s) for s in syncs)]
    typical = statistics.median(outside) if outside else 0.0
    stalls = [max((c[1] - c[0] for c in calls if overlaps(c, s)), default=s[1] - s[0]) - typical for s in syncs]
    return {"push_s": statistics.median(s[1] - s[0] for s in syncs), "sampler_stall_s": statistics.median(stalls),
            "generate_call_s": typical}


def trainer_run(url: str, model_dir: Path, mode: str, out_dir: Path, steps: int, prompts: int, generations: int,
                tokens: int) -> dict[str, float]:
    """An asynchronous full-fine-tuning GRPO run of ``steps`` steps of ``prompts`` x ``generations`` completions x
    ``tokens`` tokens sampling on the server at ``url``, weights pushed through ``mode``: the medians of what the
    trainer logged over the steps after the first."""
    from datasets import Dataset

    from grpo_ascend import GRPOConfig, GRPOTrainer

    cfg = GRPOConfig(output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=generations * prompts,
                     num_generations=generations, learning_rate=1e-6, max_completion_length=tokens,
                     max_prompt_length=64, temperature=1.0, beta=0.0,
                     save_steps=0, logging_steps=1, disable_tqdm=True, log_completions_steps=0, report_to=[],
                     use_vllm=True, vllm_mode="server", vllm_server_base_url=[url], vllm_server_timeout=900,
                     vllm_sync_dir=str(out_dir / "sync"), weight_transfer=mode, weight_sync_timeout=1800,
                     rollout_mode="async", max_staleness=2)
    prompts = Dataset.from_list([{"prompt": f"Count to {i}:"} for i in range(64)])
    trainer = GRPOTrainer(str(model_dir), token_sum, cfg, prompts)
    trainer.train()
    trainer.rollout.close()
    logged = [r for r in trainer.state.log_history if "async/weight_push_s" in r][1:]
    del trainer
    gc.collect()  # the next path's run holds a second model, its gradients and AdamW's moments
    if not logged:
        raise SystemExit(f"--trainer-steps {steps}: no step after the first was logged; give at least 2")
    return {key: statistics.median(r.get(name, 0.0) for r in logged) for key, name in (
        ("push_s", "async/weight_push_s"), ("sampler_wait_s", "async/sampler_weight_wait_s"),
        ("step_s", "time/step"), ("trainer_wait_s", "async/trainer_wait_s"),
        ("producer_idle_fraction", "async/producer_idle_fraction"))}


def token_sum(completions: list, completion_ids: list, **_: object) -> list[float]:
    """A reward with a spread inside each group, from the sampled ids (most ids of a 151,936-token vocabulary are
    past the built-in tokenizer's and decode to nothing), so every step has advantages to train on."""
    return [float(sum(ids) % 1000) / 1000 for ids in completion_ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--async-steps", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=2.0)
    parser.add_argument("--trainer-steps", type=int, default=0,
                        help="an asynchronous full-fine-tuning GRPOTrainer run of this many steps per path (0: none)")
    parser.add_argument("--trainer-prompts", type=int, default=2, help="prompts per step of that run")
    parser.add_argument("--trainer-generations", type=int, default=4, help="completions per prompt in that run")
    parser.add_argument("--trainer-tokens", type=int, default=8, help="tokens per completion in that run")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import describe

    from grpo_ascend.rollout.policy_weights import PolicyWeights

    print(describe(), flush=True)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_model(dtype, tmp / "model")
        nbytes = sum(t.numel() * t.element_size() for _, t in PolicyWeights(model, 0).named_tensors())
        print(f"model: Qwen2.5-0.5B shapes, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
              f"{args.dtype}, {nbytes / 2**30:.2f} GiB per sync", flush=True)
        with server(tmp / "model", args.dtype, tmp / "server.log") as url:
            clients = {mode: client(url, tmp / "model", mode, tmp / f"sync-{mode}") for mode in ("collective", "files")}
            assert clients["collective"].collective is not None, "the server did not offer a transfer group"
            times: dict[str, list[float]] = {"collective": [], "files": []}
            version = 0
            for repeat in range(args.repeats + 1):  # the first round warms both paths up (and builds the group)
                for mode, rollout in clients.items():
                    version += 1
                    seconds = _timed(lambda r=rollout, v=version: r.sync_weights(PolicyWeights(model, v)))
                    if repeat:
                        times[mode].append(seconds)
                    print(f"{'warm-up' if not repeat else f'repeat {repeat}'} {mode:10s} {seconds:7.2f} s", flush=True)
            memcpy = memcpy_bytes_per_s(args.copy_mib)
            result = {mode: statistics.median(ts) for mode, ts in times.items()}
            out = {"collective_s": result["collective"], "files_s": result["files"],
                   "ratio": result["collective"] / result["files"], "bytes": nbytes,
                   "collective_bytes_per_s": nbytes / result["collective"],
                   "files_bytes_per_s": nbytes / result["files"], "memcpy_bytes_per_s": memcpy,
                   "collective_wire_bytes": clients["collective"].collective.last_report.bytes_sent,
                   "dtype": args.dtype, "repeats": args.repeats, "all_s": times}
            if args.async_steps:
                for mode, rollout in clients.items():
                    figures = async_run(rollout, model, version + 1, args.async_steps, args.step_s)
                    version += args.async_steps
                    out.update({f"async_{mode}_{k}": v for k, v in figures.items()})
                    print(f"async {mode:10s} push {figures['push_s']:.2f} s/step, sampler stall "
                          f"{figures['sampler_stall_s']:.2f} s/sync (a generate call: {figures['generate_call_s']:.2f} "
                          "s)", flush=True)
            for rollout in clients.values():
                rollout.close()
            model = clients = None  # the trainer runs below load their own copies
            gc.collect()
            if args.trainer_steps:
                for mode in ("files", "collective"):
                    figures = trainer_run(url, tmp / "model", mode, tmp / f"trainer-{mode}", args.trainer_steps,
                                          args.trainer_prompts, args.trainer_generations, args.trainer_tokens)
                    out.update({f"trainer_{mode}_{k}": v for k, v in figures.items()})
                    print(f"trainer {mode:10s} push {figures['push_s']:.2f} s/step, sampler held "
                          f"{figures['sampler_wait_s']:.2f} s/step, step {figures['step_s']:.2f} s (waiting on "
                          f"the sampler {figures['trainer_wait_s']:.2f} s), sampler idle "
                          f"{figures['producer_idle_fraction']:.0%}", flush=True)
    print(f"collective {out['collective_s']:.2f} s ({out['collective_bytes_per_s'] / 2**30:.2f} GiB/s), files "
          f"{out['files_s']:.2f} s ({out['files_bytes_per_s'] / 2**30:.2f} GiB/s), ratio {out['ratio']:.2f}; memory "
          f"copy {memcpy / 2**30:.2f} GiB/s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
