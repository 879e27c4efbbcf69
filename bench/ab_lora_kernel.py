"""peft's LoRA forward vs grpo_ascend's fused kernel on one training micro-batch, alternated in one process.

Loads a model (default ``random-25m`` from bench_random_model.py), wraps it with LoRA r=16
all-linear, makes a copy with :func:`grpo_ascend.models.lora_kernel.install`, and times the forward +
backward of :class:`~grpo_ascend.models.policy.CompletionLogprobs` on one GRPO group (a shared prompt,
G completions) for each, alternating, so the machine's noise hits both alike. Prints min and
median seconds and the ratio.

Examples::

    python bench/ab_lora_kernel.py                 # 1 thread, 8 x (63 + 64) tokens
    python bench/ab_lora_kernel.py --threads 2 --completion-len 256
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random-25m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=63)
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    from machine import describe  # bench/machine.py: what the figures were measured on

    print(f"machine: {describe(args.threads)}", flush=True)

    import torch
    from bench_random_model import build_random_model
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_ascend import device as dev
    from grpo_ascend.models import lora_kernel
    from grpo_ascend.models.policy import CompletionLogprobs

    torch.set_num_threads(args.threads)
    dev.resolve_device("cpu")  # the trainer's host-allocator setting
    base = AutoModelForCausalLM.from_pretrained(build_random_model(args.model), dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    peft_model.train()
    fused = copy.deepcopy(peft_model)
    layers = lora_kernel.install(fused)
    vocab = base.config.vocab_size
    torch.manual_seed(0)
    prompt = torch.randint(5, vocab, (1, args.prompt_len)).repeat(args.rows, 1)
    completion = torch.randint(5, vocab, (args.rows, args.completion_len))
    inputs = (prompt, torch.ones_like(prompt), completion, torch.ones_like(completion))
    times: dict[str, list[float]] = {"peft": [], "fused": []}
    for _ in range(args.repeats + 1):  # the first pair warms up
        for name, model in (("peft", peft_model), ("fused", fused)):
            start = time.perf_counter()
            logps, _ = CompletionLogprobs(model)(*inputs, with_entropy=True, entropy_grad=False)
            logps.sum().backward()
            times[name].append(time.perf_counter() - start)
    print(f"{args.model}, {args.threads} thread(s), {layers} LoRA layers, {args.rows} x ({args.prompt_len} + "
          f"{args.completion_len}) tokens, forward + backward, {args.repeats} alternated repeats:")
    for name, values in times.items():
        print(f"  {name}: min {min(values[1:]):.3f} s, median {statistics.median(values[1:]):.3f} s")
    print(f"  fused / peft: min {min(times['fused'][1:]) / min(times['peft'][1:]):.3f}, "
          f"median {statistics.median(times['fused'][1:]) / statistics.median(times['peft'][1:]):.3f}")


if __name__ == "__main__":
    main()
