"""GRPO step time and memory on a random-weight model whose shapes we did not pick: grpo_ascend vs TRL.

The built-in ``small`` model is warm-started and its shapes were chosen here; this benchmark
checks that the numbers hold on a model built the way an outside user would build one: a plain
``Qwen2Config`` with transformers' defaults for everything but the sizes below (so untied
input/output embeddings, 32,768 positions, rope theta 10,000), random weights from seed 0:

* ``random-25m``: hidden 512, 8 layers, 8 query / 4 key-value heads, intermediate 1,376, the
  built-in byte-level tokenizer's vocabulary (556 entries): 23.8M parameters.

Random weights almost never emit EOS, and the run forces it anyway (``--lengths fixed``, the
default: ours samples with ``ignore_eos``, TRL's ``generate`` gets ``min_new_tokens``), so every
completion has the full 64 tokens on both sides. Defaults: 4 prompts × G=8 (32 completions, 4
micro-batches of 8) per optimizer step, 64 new tokens, LoRA r=16 all-linear, β=0.04, fp32 on the
CPU, 1 warm-up + 3 timed steps, 2 runs each, the two trainers taking turns step by step.

The run itself is :mod:`bench_trainer`'s (each trainer in a fresh subprocess; every
``bench_trainer.py`` option passes through, e.g. ``--interleave runs``): the time of each
optimizer step, peak RSS
during ``train()``, and the split per phase (ours from metrics.jsonl: time and the peak RSS of
each phase, ``memory/peak_gb/<phase>``; TRL's time from its profiling blocks).

Examples::

    python bench/bench_random_model.py                  # 2 threads (this machine's default)
    python bench/bench_random_model.py --threads 1 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: Sizes of the random-weight models; every other Qwen2Config field keeps transformers' default.
RANDOM_MODELS: dict[str, dict[str, int]] = {
    "random-25m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=1376),
    # the same with a 4,096-token vocabulary (the output head then costs as much as two decoder layers)
    "random-25m-v4k": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           intermediate_size=1376, vocab_size=4096),
}


def build_random_model(name: str) -> Path:
    """Directory of the random-weight model ``name`` (see RANDOM_MODELS) with the built-in tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config

    from grpo_ascend.models.tiny_model import build_tiny_model, cache_dir

    if name not in RANDOM_MODELS:
        raise SystemExit(f"unknown random model {name!r}; expected one of {', '.join(RANDOM_MODELS)}")
    target = cache_dir() / f"{name}-s0"
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model("small"))
    sizes = {"vocab_size": len(tokenizer), **RANDOM_MODELS[name]}
    config = Qwen2Config(pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **sizes)
    from bench_real_shape import save_random_model

    return save_random_model(target, tokenizer, config)


def main(argv: list[str] | None = None) -> None:
    import bench_trainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--model", default="random-25m", choices=sorted(RANDOM_MODELS))
    known, rest = parser.parse_known_args(argv)
    build_random_model(known.model)  # once, before the workers start
    bench_trainer.main(["--model-config", known.model, *rest])


if __name__ == "__main__":
    main()
