"""SDPA vs the grouped batched-matmul attention in the log-prob forwards, alternated in one process.

Loads a model (default ``random-25m`` from bench_random_model.py; ``qwen2.5-0.5b-<n>l`` from
bench_real_shape.py), wraps it with LoRA r=16 all-linear and the fused LoRA kernel, as the trainer
does, and times :class:`~grpo_ascend.models.policy.CompletionLogprobs` on one GRPO group (a shared,
left-padded prompt and G completions): forward + backward (the training phase) and a forward under
``no_grad`` with the adapters off (the reference phase), once with the device's grouped-attention
budget (grpo_ascend/models/grouped_attention.py) and once with it set to 0 (transformers' SDPA),
alternating so the machine's noise hits both alike. Prints min and median seconds, the ratios, and
whether the grouped path ran (blocks over the budget stay on SDPA).

Examples::

    python bench/ab_training_attention.py                        # random-25m, 1 thread, 8 x (63 + 64)
    python bench/ab_training_attention.py --threads 2
    python bench/ab_training_attention.py --model qwen2.5-0.5b-2l --completion-len 256
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--prompt-padding", type=int, default=8, help="left-padding positions of the prompt")
    parser.add_argument("--completion-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    from machine import describe  # bench/machine.py: what the figures were measured on

    print(f"machine: {describe(args.threads)}", flush=True)

    import torch
    from bench_rollout import load_model
    from peft import LoraConfig, get_peft_model

    from grpo_ascend import device as dev
    from grpo_ascend.models import grouped_attention, lora_kernel
    from grpo_ascend.models.parameters import adapters_disabled
    from grpo_ascend.models.policy import CompletionLogprobs

    torch.set_num_threads(args.threads)
    dev.resolve_device("cpu")  # the trainer's host-allocator setting
    model, _ = load_model(args.model, torch.float32, torch.device("cpu"))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.train()
    lora_kernel.install(model)
    vocab = model.config.vocab_size
    torch.manual_seed(0)
    prompt = torch.randint(5, vocab, (1, args.prompt_len)).repeat(args.rows, 1)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[:, : args.prompt_padding] = 0
    completion = torch.randint(5, vocab, (args.rows, args.completion_len))
    inputs = (prompt, prompt_mask, completion, torch.ones_like(completion))
    forward = CompletionLogprobs(model)

    calls = {"grouped": 0}
    plain_attend = grouped_attention.grouped_softmax_attention

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls["grouped"] += 1
        return plain_attend(*a, **k)

    grouped_attention.grouped_softmax_attention = counted
    budget = dev.grouped_attention_max_bytes
    settings = {"grouped": budget, "sdpa": lambda device: 0}

    def training() -> None:
        logps, _ = forward(*inputs, with_entropy=True, entropy_grad=False)
        logps.sum().backward()

    def reference() -> None:
        with torch.no_grad(), adapters_disabled(model):
            forward(*inputs)

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for phase, run in (("training", training), ("reference", reference)):
            for name, setting in settings.items():
                dev.grouped_attention_max_bytes = setting
                start = time.perf_counter()
                run()
                times.setdefault((phase, name), []).append(time.perf_counter() - start)
    dev.grouped_attention_max_bytes = budget
    print(f"{args.model}, {args.threads} thread(s), {args.rows} x ({args.prompt_len} + {args.completion_len}) tokens "
          f"(prompt padding {args.prompt_padding}), {args.repeats} alternated repeats; grouped path taken in "
          f"{calls['grouped']} attention calls (budget {budget(torch.device('cpu')) >> 20} MiB of scores per call):")
    for phase in ("training", "reference"):
        grouped, sdpa = times[(phase, "grouped")][1:], times[(phase, "sdpa")][1:]
        print(f"  {phase}: grouped min {min(grouped):.3f} / median {statistics.median(grouped):.3f} s, "
              f"SDPA min {min(sdpa):.3f} / median {statistics.median(sdpa):.3f} s; grouped / SDPA: "
              f"min {min(grouped) / min(sdpa):.3f}, median {statistics.median(grouped) / statistics.median(sdpa):.3f}")


if __name__ == "__main__":
    main()
