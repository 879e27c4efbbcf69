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

The last line printed is one JSON object: ``collective_s``, ``files_s`` (medians), ``ratio`` (collective / files),
``bytes``, ``collective_bytes_per_s``, ``files_bytes_per_s``, ``memcpy_bytes_per_s``, and the async figures.

Examples::

    python bench/bench_weight_transfer.py                     # float32, 3 repeats
    python bench/bench_weight_transfer.py --dtype bfloat16 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
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
    from grpo_ascend.rollout.backend import PolicyWeights

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--async-steps", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=2.0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import describe

    from grpo_ascend.rollout.backend import PolicyWeights

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
    print(f"collective {out['collective_s']:.2f} s ({out['collective_bytes_per_s'] / 2**30:.2f} GiB/s), files "
          f"{out['files_s']:.2f} s ({out['files_bytes_per_s'] / 2**30:.2f} GiB/s), ratio {out['ratio']:.2f}; memory "
          f"copy {memcpy / 2**30:.2f} GiB/s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
