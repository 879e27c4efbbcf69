"""GRPO step time and memory at a real model's shapes: grpo_ascend vs TRL's GRPOTrainer, side by side.

The model has Qwen2.5-0.5B's configuration (vocabulary 151,936, hidden 896, 14 query / 2 key-value
heads, intermediate 4,864, tied embeddings) with fewer decoder layers (2 by default) and random
weights, so the output projection dominates as it does at that vocabulary. It uses the built-in
byte-level tokenizer: ids beyond the tokenizer's ~550 decode to nothing (a real Qwen checkpoint
also has more embedding rows than tokenizer entries), which only shortens the decoded texts.
Completions are long (256 new tokens by default, every completion at full length) and
2 prompts × G=8 = 16 completions make one optimizer step (2 micro-batches of 8).

The run itself is :mod:`bench_trainer`'s: each trainer in a fresh subprocess, the two taking turns
step by step, TRL from ``--python`` (a separate virtual environment with ``trl==1.16.0``; the
default is this interpreter), the time of each optimizer step after a warm-up step, peak RSS
during ``train()``, and the per-phase
split (ours from metrics.jsonl, TRL's from its profiling blocks). The model is built once and
cached next to the built-in models.

Examples::

    python bench/bench_real_shape.py --python /work/venv-trl/bin/python
    python bench/bench_real_shape.py --python /work/venv-trl/bin/python --layers 4 --new-tokens 512
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

QWEN25_05B = dict(
    vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
    max_position_embeddings=32_768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
PREFIX = "qwen2.5-0.5b-"


def build_real_shape_model(name: str) -> Path:
    """Directory of a random-weight model named ``qwen2.5-0.5b-<layers>l`` with the built-in tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config

    from grpo_ascend.models.tiny_model import build_tiny_model, cache_dir

    if not (name.startswith(PREFIX) and name.endswith("l") and name[len(PREFIX):-1].isdigit()):
        raise SystemExit(f"real-shape model names look like {PREFIX}2l (the layer count before 'l'), got {name!r}")
    target = cache_dir() / f"{name}-s0"
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model("small"))
    config = Qwen2Config(num_hidden_layers=int(name[len(PREFIX):-1]), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **QWEN25_05B)
    return save_random_model(target, tokenizer, config)


def save_random_model(target: Path, tokenizer, config) -> Path:
    """A seed-0 random-weight fp32 Qwen2 of ``config`` with ``tokenizer``, saved to ``target`` (via a temp folder)."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def main(argv: list[str] | None = None) -> None:
    import bench_trainer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--layers", type=int, default=2)
    known, rest = parser.parse_known_args(argv)
    name = f"{PREFIX}{known.layers}l"
    build_real_shape_model(name)  # once, before the workers start
    defaults = ["--model-config", name, "--new-tokens", "256", "--prompts-per-step", "2", "--steps", "1",
                "--repeats", "1"]
    bench_trainer.main(defaults + rest)


if __name__ == "__main__":
    main()
