"""Offline, deterministic tiny Qwen2-architecture models and a byte-level BPE tokenizer.

Tests, benchmarks and the default recipe need a real causal LM without any download. The builder
trains a small byte-level BPE tokenizer on generated text, builds a Qwen2 model from a fixed seed,
optionally warm-starts it with a short supervised run on the synthetic arithmetic task (so that RL
has signal), and saves both with ``save_pretrained``. Builds are cached per size and version.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_ascend.data.synthetic import arithmetic_problems, conversation
from grpo_ascend.errors import ConfigError, closest
from grpo_ascend.models import builtin_weights
from grpo_ascend.models.build_cache import build_lock as _build_lock
from grpo_ascend.models.build_cache import cache_dir, write_atomically
from grpo_ascend.models.seeding import seeded
from grpo_ascend.models.tiny_tokenizer import COMPACT_TOOLS_CHAT_TEMPLATE, VOCAB_SIZE, build_tokenizer
from grpo_ascend.models.tiny_tool_warm import TOOL_WARM_PHASES, tool_warm_phase, tool_warm_start
from grpo_ascend.models.tiny_vlm import resolve_builtin_vlm
from grpo_ascend.models.warm_step import supervised_step

logger = logging.getLogger(__name__)

# Version 3: tool-calling tokens appended to the vocabulary (their embedding rows added after the
# warm start, so every other weight equals version 2's) and a chat template that renders tools.
BUILD_VERSION = 3
# The ``-tool-warm`` variant's own version (its cache folder is ``<size>-tool-warm-s<seed>-v3.<this>``).
TOOL_WARM_VERSION = 2
#: Built-in model flavours: ``builtin:<size>``, ``-warm`` (arithmetic warm start), ``-tool-warm``
#: (then calculator transcripts; compact tool prompt).
FLAVOURS = ("", "warm", "tool-warm")
#: Other built-in kinds, by the word before the first ``-``: ``builtin:vlm-<family>`` (vision-language).
OTHER_BUILTINS = {"vlm": resolve_builtin_vlm}
@dataclass(frozen=True)
class TinySize:
    """Architecture of one built-in size."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


SIZES: dict[str, TinySize] = {
    # ~1.8M parameters: unit tests and the CPU demo.
    "tiny": TinySize(192, 4, 6, 2, 512),
    # ~25M parameters: benchmarks.
    "small": TinySize(512, 8, 8, 4, 1408),
}

def build_model(size: str, tokenizer, seed: int = 0):
    """A randomly initialised Qwen2ForCausalLM of the given built-in size, reproducible by ``seed``,
    with embeddings for the whole tokenizer (tool tokens included)."""
    return add_tool_token_embeddings(build_base_model(size, tokenizer, seed), tokenizer, seed)


def build_base_model(size: str, tokenizer: Any, seed: int = 0) -> Any:
    """The random-init model over the BPE vocabulary only (:func:`add_tool_token_embeddings` adds the tool
    tokens after training): the same weights as build version 2, so the warm start is unchanged."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = _size(size)
    config = Qwen2Config(
        vocab_size=tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with seeded(seed):
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    model.to(torch.float32)
    return model


def add_tool_token_embeddings(model, tokenizer, seed: int = 0):
    """Grow the (tied) embeddings to the tokenizer's full size; the tool tokens' rows are drawn from
    the existing embeddings' mean and covariance (transformers' mean resizing), reproducibly."""
    from transformers.utils import logging as hf_logging

    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the resize explains mean resizing at warning level
        try:
            with seeded(seed + 1):
                model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        finally:
            hf_logging.set_verbosity(verbosity)
    return model


def warm_start(model, tokenizer, steps: int = 300, batch_size: int = 32, lr: float = 1e-3, seed: int = 0,
               losses: list[float] | None = None):
    """Short supervised run on the synthetic task (loss on the completion only) so RL starts with signal.

    Each step's loss is appended to ``losses`` when given; the first ``n`` steps of a run with
    ``steps=n`` are those of the full run (the shipped weights' manifest records them).

    Deliberately brief: stopped before the model masters the task (it learns the answer format
    and gets roughly a fifth to a third of the sums right), which leaves accuracy for RL to improve.
    """
    import torch

    problems = arithmetic_problems(steps * batch_size, seed=seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    with seeded(seed):
        for step in range(steps):
            batch = problems[step * batch_size : (step + 1) * batch_size]
            ids, labels = _sft_batch(tokenizer, batch)
            attn = (ids != tokenizer.pad_token_id).long()
            loss = supervised_step(model, opt, sched, ids, attn, labels, losses)
            if step % 100 == 0 or step == steps - 1:
                logger.info("warm start step %d/%d loss %.4f", step + 1, steps, loss)
    model.eval()
    return model


def _sft_batch(tokenizer, problems):
    """Right-padded ids with labels masked (-100) everywhere except the completion and its EOS."""
    import torch

    rows, labels = [], []
    for p in problems:
        prompt = tokenizer.apply_chat_template(conversation(p.question), tokenize=False, add_generation_prompt=True)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(p.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p_ids + c_ids)
        labels.append([-100] * len(p_ids) + c_ids)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, lab


def build_name(size: str, warm: bool = False, tools: bool = False, seed: int = 0) -> str:
    """The cache folder name of a built-in model (also the name of its shipped weights)."""
    if tools:
        return f"{size}-tool-warm-s{seed}-v{BUILD_VERSION}.{TOOL_WARM_VERSION}"
    return f"{size}{'-warm' if warm else ''}-s{seed}-v{BUILD_VERSION}"


def build_tiny_model(
    size: str = "tiny",
    warm: bool = False,
    out_dir: str | os.PathLike | None = None,
    force: bool = False,
    seed: int = 0,
    tools: bool = False,
    from_scratch: bool = False,
) -> Path:
    """Build (or reuse from the cache) a built-in model + tokenizer and return its directory.

    The directory loads with ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained``. ``warm=True`` adds the supervised warm start; ``tools=True``
    (``builtin:<size>-tool-warm``) continues the warm model with calculator transcripts
    (:mod:`grpo_ascend.models.tiny_tool_warm`) and gives its tokenizer the compact-tools chat template.
    Warm starts shipped in :mod:`grpo_ascend.models.builtin_weights` (seed 0) are installed instead of
    trained, so they are the same on every machine; ``from_scratch=True`` trains them anyway.
    """
    _size(size)
    build = _Build(size, warm or tools, tools, seed, from_scratch)
    target = Path(out_dir) if out_dir is not None else cache_dir() / build.folder
    if not force and _is_built(target, build):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if not force and _is_built(target, build):
            return target  # another process built it while this one waited
        return _build_into(target, build)


def _is_built(target: Path, build: _Build) -> bool:
    """Whether ``target`` holds ``build``; a folder trained here is replaced once its weights are shipped,
    so every machine runs the same warm start."""
    if not ((target / "config.json").exists() and (target / "tokenizer.json").exists()):
        return False
    entry = None if build.from_scratch else builtin_weights.manifest().get(build.name)
    weights = target / "model.safetensors"
    return entry is None or (weights.exists() and builtin_weights.file_sha256(weights) == entry["sha256"])


@dataclass(frozen=True)
class _Build:
    """What one build makes (see :func:`build_tiny_model`)."""

    size: str
    warm: bool
    tools: bool
    seed: int
    from_scratch: bool

    @property
    def name(self) -> str:
        """The build's name, also the key of its shipped weights."""
        return build_name(self.size, self.warm, self.tools, self.seed)

    @property
    def folder(self) -> str:
        """The cache folder: a from-scratch build of a shipped warm start is kept apart from it."""
        return f"{self.name}-scratch" if self.from_scratch and builtin_weights.manifest().get(self.name) else self.name


def _build_into(target: Path, build: _Build) -> Path:
    """Build the model in a temporary folder next to ``target`` and rename it into place."""

    def write(tmp: Path) -> None:
        model, tokenizer, shipped = _built_model(build)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if shipped is not None:  # the shipped bytes themselves: their checksum marks the folder as current
            shutil.copyfile(shipped, tmp / "model.safetensors")

    return write_atomically(target, write)


def _built_model(build: _Build):
    """(model, tokenizer, shipped weights file or None) of ``build``: the shipped warm start when there
    is one, else trained here."""
    import torch

    tokenizer = build_tokenizer(seed=build.seed)
    if build.tools:
        tokenizer.chat_template = COMPACT_TOOLS_CHAT_TEMPLATE
    shipped = None if build.from_scratch else builtin_weights.verify(build.name, tokenizer)
    if shipped is not None:
        return _load_shipped(build, tokenizer, shipped), tokenizer, shipped
    if build.tools:
        from transformers import AutoModelForCausalLM

        # the warm model it starts from is built (and cached) first, as builtin:<size>-warm
        warm = build_tiny_model(build.size, warm=True, seed=build.seed, from_scratch=build.from_scratch)
        model = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)
        logger.info("building %s: calculator warm start (minutes of CPU)", build.name)
        return tool_warm_start(model, tokenizer, seed=build.seed), tokenizer, None
    model = build_base_model(build.size, tokenizer, seed=build.seed)
    if build.warm:
        logger.info("building %s: supervised warm start (a minute or two of CPU)", build.name)
        warm_start(model, tokenizer, seed=build.seed)
    return add_tool_token_embeddings(model, tokenizer, seed=build.seed), tokenizer, None


def first_warm_start_losses(size: str = "tiny", tools: bool = False, seed: int = 0, steps: int = 8) -> list[float]:
    """The losses of the first ``steps`` optimizer steps of a warm start, run here from its real start
    (the random init for ``-warm``; the shipped or cached ``-warm`` model for ``-tool-warm``): seconds
    of CPU that tell whether the code still builds what was shipped (see :mod:`grpo_ascend.models.builtin_weights`)."""
    import dataclasses

    losses: list[float] = []
    if tools:
        from transformers import AutoModelForCausalLM

        tokenizer = build_tokenizer(seed=seed)
        tokenizer.chat_template = COMPACT_TOOLS_CHAT_TEMPLATE
        model = AutoModelForCausalLM.from_pretrained(build_tiny_model(size, warm=True, seed=seed))
        first = TOOL_WARM_PHASES[0]
        tool_warm_phase(model, tokenizer, dataclasses.replace(first, steps=steps), seed + first.seed_offset, losses)
    else:
        tokenizer = build_tokenizer(seed=seed)
        warm_start(build_base_model(size, tokenizer, seed=seed), tokenizer, steps=steps, seed=seed, losses=losses)
    return losses


def _load_shipped(build: _Build, tokenizer, path: Path):
    """The model architecture of ``build`` with the shipped tensors loaded (tied head re-tied)."""
    from safetensors.torch import load_file

    model = build_model(build.size, tokenizer, seed=build.seed)
    missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"shipped weights {path.name} do not fit builtin:{build.size}: "
                           f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.eval()
    return model


def resolve_builtin(name: str) -> Path | None:
    """Map ``builtin:tiny``, ``builtin:tiny-warm``, ``builtin:tiny-tool-warm``, ``builtin:small`` (and
    ``builtin:vlm-<family>``, see :data:`OTHER_BUILTINS`) to a built model directory."""
    if not name.startswith("builtin:"):
        return None
    spec = name.split(":", 1)[1]
    size, _, flavour = spec.partition("-")
    if size in OTHER_BUILTINS:
        return OTHER_BUILTINS[size](flavour)
    if flavour not in FLAVOURS:
        raise ConfigError(
            f"unknown built-in model {name!r}: expected builtin:<size>[-warm|-tool-warm], size in {sorted(SIZES)}, "
            f"or builtin:vlm-<family>"
        )
    return build_tiny_model(size, warm=flavour != "", tools=flavour == "tool-warm")


def builtin_architecture(name: str) -> dict[str, Any]:
    """The config.json values of a ``builtin:*`` model without building it (for ``grpo-ascend plan``).

    The sizes come from :data:`SIZES`; the vocabulary is the built model's when it is in the cache,
    else :data:`VOCAB_SIZE`, the most the trained tokenizer can have (the built one has a few hundred).
    """
    spec = name.split(":", 1)[1] if name.startswith("builtin:") else name
    size, _, flavour = spec.partition("-")
    if size in OTHER_BUILTINS:
        raise ConfigError(f"{name!r} cannot be planned: grpo-ascend plan knows text models only")
    if flavour not in FLAVOURS:
        raise ConfigError(f"unknown built-in model {name!r}: expected builtin:<size>[-warm|-tool-warm], size in {sorted(SIZES)}")
    arch = _size(size)
    config = {"model_type": "qwen2", "vocab_size": VOCAB_SIZE, "hidden_size": arch.hidden_size,
              "num_hidden_layers": arch.num_hidden_layers, "num_attention_heads": arch.num_attention_heads,
              "num_key_value_heads": arch.num_key_value_heads, "intermediate_size": arch.intermediate_size,
              "tie_word_embeddings": True, "dtype": "float32"}
    for built in sorted(cache_dir().glob(f"{size}-s0-v{BUILD_VERSION}/config.json")):
        config["vocab_size"] = json.loads(built.read_text())["vocab_size"]
    return config


def _size(size: str) -> TinySize:
    if size not in SIZES:
        raise ConfigError(f"unknown tiny model size {size!r}; expected one of {sorted(SIZES)}{closest(size, SIZES)}")
    return SIZES[size]


def add_build_arguments(parser) -> None:
    """Arguments of ``grpo-ascend build-tiny-model``."""
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model size (default tiny)")
    parser.add_argument("--warm", action="store_true", help="add the supervised warm start on the synthetic task")
    parser.add_argument("--tools", action="store_true",
                        help="the tool-use variant (implies --warm): calculator transcripts, compact tool prompt")
    parser.add_argument("--out", default=None, help="folder to write (default: the cache, reused if present)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokenizer, weights and warm start")
    parser.add_argument("--from-scratch", action="store_true",
                        help="train the warm start here even where its weights are shipped (minutes of CPU)")


def run_build(ns) -> int:
    """``grpo-ascend build-tiny-model``: build (or find) a built-in model and print its folder."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = build_tiny_model(ns.size, warm=ns.warm or ns.tools, out_dir=ns.out, force=ns.force, seed=ns.seed,
                            tools=ns.tools, from_scratch=ns.from_scratch)
    print(path)
    return 0
