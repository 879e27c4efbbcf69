"""Offline stand-ins for the tiny Hugging Face Hub models and datasets TRL's tests load (for
``bench/trl_tests_harness.py``).

Every model is its real architecture in miniature with seeded random weights and a tokenizer or processor from
``trl_standin_tokenizers``, written in the Hugging Face cache's layout (``models--org--name/snapshots/<rev>/``)
so that ``from_pretrained("trl-internal-testing/...")`` resolves it with ``HF_HUB_OFFLINE=1``. The datasets
(``trl-internal-testing/zen``, ``zen-image``, ``zen-multi-image``) are folders of parquet files with their configs
in ``README.md``; the harness's pytest plugin maps the ids to them. A model whose architecture this transformers
cannot build is reported and left out: the tests that load it fail the same way for both trainers.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trl_standin_tokenizers import build_tokenizer

logger = logging.getLogger(__name__)

#: Part of every stand-in's fake commit hash: bump it when a builder's output changes.
STANDIN_VERSION = 3
#: The text decoder of every stand-in: 2 layers, hidden 16, 4 query heads of 4 over 2 key/value heads.
TEXT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 4, "max_position_embeddings": 4096}
#: A 2-layer vision tower (CLIP / SigLIP shaped) on 14-pixel patches.
VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}


@dataclass(frozen=True)
class StandIn:
    """How to build one hub id: its tokenizer family and a function (tokenizer, out_dir) -> None that saves the
    model (and the processor, for vision-language models) into ``out_dir``."""

    family: str
    build: Callable[..., None]


def special_ids(tokenizer, vocab: int | None = None) -> dict:
    """The config's vocabulary size and bos / eos / pad ids, from the tokenizer."""
    return {"vocab_size": vocab or len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def save_text_model(config, model_class: str, tokenizer, out: Path) -> None:
    """Seed, build ``model_class`` from ``config``, save it with its tokenizer and generation config."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.float32)
    if hasattr(model, "generation_config") and model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def text(config_class: str, model_class: str, vocab: int | None = None, **overrides) -> Callable[..., None]:
    """A builder of a text model: ``config_class`` with :data:`TEXT`, the tokenizer's ids and ``overrides``."""

    def build(tokenizer, out: Path) -> None:
        import transformers

        settings = {**TEXT, **special_ids(tokenizer, vocab), **overrides}
        config = getattr(transformers, config_class)(**settings)
        if model_class.endswith("ForSequenceClassification"):
            config.num_labels = 1
        save_text_model(config, model_class, tokenizer, out)

    return build


REMOTE_CONFIG = '''from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
'''
REMOTE_MODEL = '''from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
'''


def remote(tokenizer, out: Path) -> None:
    """A model whose code lives in its folder (``auto_map``), loadable only with ``trust_remote_code=True``: a
    Qwen2 decoder under its own class names (the weights are Qwen2's, saved by the plain Qwen2 class)."""
    from transformers import Qwen2Config

    config = Qwen2Config(**{**TEXT, **special_ids(tokenizer)}, tie_word_embeddings=True)
    save_text_model(config, "Qwen2ForCausalLM", tokenizer, out)
    (out / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (out / "modeling_remote.py").write_text(REMOTE_MODEL)
    config_json = json.loads((out / "config.json").read_text())
    config_json.update(model_type="remote", architectures=["RemoteForCausalLM"],
                       auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                                 "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (out / "config.json").write_text(json.dumps(config_json, indent=2))


def save_vlm(model, processor, out: Path) -> None:
    model.save_pretrained(out)
    processor.save_pretrained(out)


def llava_next(tokenizer, out: Path) -> None:
    """LLaVA-NeXT: a CLIP tower (feature layer -2, as the real checkpoints) and a Mistral decoder; images are
    tiled onto a 28-pixel grid. The processor counts the tower's CLS token before the "default" strategy drops it
    (``num_additional_image_tokens=1``, as the real processors): without it each image had one token fewer than
    the model's features."""
    import torch
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    image_id = tokenizer.convert_tokens_to_ids("<image>")
    config = LlavaNextConfig(
        vision_config={"model_type": "clip_vision_model", **VISION, "image_size": 28, "patch_size": 14,
                       "projection_dim": 16},
        text_config={"model_type": "mistral", **TEXT, **special_ids(tokenizer)},
        image_token_index=image_id, image_grid_pinpoints=[[28, 28], [28, 56], [56, 28]],
        vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config)
    image_processor = LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                              image_grid_pinpoints=[[28, 28], [28, 56], [56, 28]])
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=tokenizer.chat_template)
    save_vlm(model, processor, out)


def gemma3(tokenizer, out: Path) -> None:
    """Gemma 3: a SigLIP tower without its pooling head (as the real ones: the head's output is unused, so it
    would never train) pooled to 4 image tokens and a Gemma 3 decoder."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    config = Gemma3Config(
        vision_config={"model_type": "siglip_vision_model", **VISION, "image_size": 28, "patch_size": 7,
                       "vision_use_head": False},
        text_config={"model_type": "gemma3_text", **TEXT, **special_ids(tokenizer), "sliding_window": 64},
        mm_tokens_per_image=4, boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"))
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    image_processor = Gemma3ImageProcessor(size={"height": 28, "width": 28})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=tokenizer.chat_template)
    save_vlm(model, processor, out)


def gemma4(tokenizer, out: Path) -> None:
    """Gemma 4 without its audio tower: a 2-layer vision encoder (7-pixel patches pooled 2x2, at most 70 image
    tokens), a sliding- then a full-attention text layer with per-layer inputs; the image-only processor (its
    video part needs torchvision)."""
    import torch
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessorPil,
    )

    from grpo_ascend.models.tiny_vlm_processors import image_only_processor

    ids = tokenizer.convert_tokens_to_ids
    config = Gemma4Config(
        text_config={**TEXT, **special_ids(tokenizer), "sliding_window": 64, "global_head_dim": TEXT["head_dim"],
                     "layer_types": ["sliding_attention", "full_attention"], "vocab_size_per_layer_input": len(tokenizer),
                     "hidden_size_per_layer_input": 8},
        vision_config={**VISION, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 7, "pooling_kernel_size": 2,
                       "position_embedding_size": 64},
        audio_config=None, boi_token_id=ids("<|image>"), eoi_token_id=ids("<image|>"), image_token_id=ids("<|image|>"),
        video_token_id=ids("<|video|>"), boa_token_id=ids("<|audio>"), eoa_token_index=ids("<audio|>"),
        audio_token_id=ids("<|audio|>"))
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config)
    images = Gemma4ImageProcessorPil(patch_size=7, max_soft_tokens=70, pooling_kernel_size=2)
    processor = image_only_processor("Gemma4Processor")(
        feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images, tokenizer=tokenizer,
        chat_template=tokenizer.chat_template, image_seq_length=70)
    save_vlm(model, processor, out)


#: The text decoder of the Qwen-VL stand-ins: 2 query heads of 16 over 1 key/value head (a head of 4 leaves the
#: multimodal rotary sections no room).
QWEN_VL_TEXT = {**TEXT, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def qwen2_vl(tokenizer, out: Path) -> None:
    """Qwen2-VL: a 2-block vision tower (14-pixel patches merged 2x2) and a Qwen2 decoder with 3D (mrope)
    positions; the image-only processor (PIL, no torchvision) at 28x28 to 56x56 pixels."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from grpo_ascend.models.tiny_vlm import qwen_vl_processor

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config={**QWEN_VL_TEXT, **special_ids(tokenizer), "rope_parameters": {
            "rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": QWEN_VL_TEXT["hidden_size"], "num_heads": 2,
                       "mlp_ratio": 2, "patch_size": 7, "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(0)
    save_vlm(Qwen2VLForConditionalGeneration(config), qwen_vl_processor(tokenizer, "Qwen2VLProcessor"), out)


def qwen3_5(moe: bool) -> Callable[..., None]:
    """Qwen3.5 (``moe``: Qwen3.5 MoE): grpo-ascend's tiny configuration (a hybrid linear- and full-attention
    decoder, ``grpo_ascend.models.tiny_vlm.qwen3_5_config``) on the stand-in tokenizer and its TRL template."""

    def build(tokenizer, out: Path) -> None:
        import torch
        import transformers

        from grpo_ascend.models.tiny_vlm import qwen3_5_config, qwen_vl_processor

        text = {k: QWEN_VL_TEXT[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}
        model_class = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(qwen3_5_config(tokenizer, text, moe=moe))
        save_vlm(model, qwen_vl_processor(tokenizer, "Qwen3VLProcessor"), out)

    return build


def grpo_ascend_vlm(family: str) -> Callable[..., None]:
    """A vision-language model of grpo-ascend's own tiny builds (``build_tiny_vlm``), tokenizer included."""

    def build(tokenizer, out: Path) -> None:
        from grpo_ascend.models.tiny_vlm import build_tiny_vlm

        build_tiny_vlm(family, seed=0, out_dir=out)

    return build


ORG = "trl-internal-testing"
STANDINS: dict[str, StandIn] = {
    f"{ORG}/tiny-Qwen2ForCausalLM-2.5": StandIn("qwen2_5", text("Qwen2Config", "Qwen2ForCausalLM",
                                                                  tie_word_embeddings=True)),
    f"{ORG}/tiny-Qwen2ForSequenceClassification-2.5": StandIn(
        "qwen2_5", text("Qwen2Config", "Qwen2ForSequenceClassification")),
    f"{ORG}/tiny-Qwen3ForCausalLM": StandIn("qwen3", text("Qwen3Config", "Qwen3ForCausalLM",
                                                          tie_word_embeddings=False)),
    f"{ORG}/tiny-Qwen3ForSequenceClassification": StandIn(
        "qwen3", text("Qwen3Config", "Qwen3ForSequenceClassification")),
    f"{ORG}/tiny-Qwen3MoeForCausalLM": StandIn("qwen3", text(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, decoder_sparse_step=1, tie_word_embeddings=False)),
    f"{ORG}/tiny-LlamaForCausalLM-3.2": StandIn("llama3_2", text("LlamaConfig", "LlamaForCausalLM",
                                                                 tie_word_embeddings=True)),
    f"{ORG}/tiny-LlamaForSequenceClassification-3.2": StandIn(
        "llama3_2", text("LlamaConfig", "LlamaForSequenceClassification")),
    f"{ORG}/tiny-MistralForCausalLM-0.2": StandIn("mistral", text("MistralConfig", "MistralForCausalLM")),
    f"{ORG}/tiny-Gemma2ForCausalLM": StandIn("gemma", text("Gemma2Config", "Gemma2ForCausalLM",
                                                          tie_word_embeddings=True, sliding_window=64)),
    f"{ORG}/tiny-Cohere2ForCausalLM": StandIn("cohere2", text("Cohere2Config", "Cohere2ForCausalLM",
                                                             sliding_window=64)),
    f"{ORG}/tiny-Glm4MoeForCausalLM": StandIn("glm4moe", text(
        "Glm4MoeConfig", "Glm4MoeForCausalLM", n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1)),
    f"{ORG}/tiny-GptOssForCausalLM": StandIn("gptoss", text(
        "GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"])),
    f"{ORG}/tiny-NemotronHForCausalLM-nano": StandIn("qwen3", text(
        "NemotronHConfig", "NemotronHForCausalLM", hybrid_override_pattern="M*",
        mamba_num_heads=4, mamba_head_dim=4, ssm_state_size=8, n_groups=1, num_hidden_layers=2)),
    f"{ORG}/tiny-RemoteForCausalLM": StandIn("qwen2_5", remote),
    f"{ORG}/tiny-LlavaForConditionalGeneration": StandIn("llava", grpo_ascend_vlm("llava")),
    f"{ORG}/tiny-Qwen2_5_VLForConditionalGeneration": StandIn("qwen2_5_vl", grpo_ascend_vlm("qwen2_5_vl")),
    f"{ORG}/tiny-LlavaNextForConditionalGeneration": StandIn("llava", llava_next),
    f"{ORG}/tiny-Gemma3ForConditionalGeneration": StandIn("gemma3", gemma3),
    f"{ORG}/tiny-Gemma4ForConditionalGeneration": StandIn("gemma4", gemma4),
    f"{ORG}/tiny-Qwen2VLForConditionalGeneration": StandIn("qwen2_5_vl", qwen2_vl),
    f"{ORG}/tiny-Qwen3_5ForConditionalGeneration-NoThink": StandIn("qwen3_5", qwen3_5(moe=False)),
    f"{ORG}/tiny-Qwen3_5MoeForConditionalGeneration-3.6": StandIn("qwen3_6", qwen3_5(moe=True)),
}


def revision(hub_id: str) -> str:
    """The stand-in's fake commit hash: stable per id and :data:`STANDIN_VERSION`."""
    return hashlib.sha1(f"{hub_id}@standin-v{STANDIN_VERSION}".encode()).hexdigest()


def snapshot(hub: Path, hub_id: str, kind: str = "models") -> Path:
    """``hub_id``'s snapshot folder in the cache rooted at ``hub``."""
    return hub / f"{kind}--{hub_id.replace('/', '--')}" / "snapshots" / revision(hub_id)


def build_models(hub: Path, ids: list[str]) -> dict[str, str]:
    """Build every stand-in of ``ids`` not built yet into the cache ``hub``; returns {id: error} for those that
    could not be built (the others are ready)."""
    failures = {}
    for hub_id in ids:
        folder = snapshot(hub, hub_id)
        marker = folder / ".standin-complete"
        if marker.exists():
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                standin = STANDINS[hub_id]
                standin.build(build_tokenizer(standin.family), folder)
        except Exception as error:  # noqa: BLE001 - reported per model; its tests fail on both sides
            failures[hub_id] = f"{type(error).__name__}: {error}"
            logger.warning("stand-in %s not built: %s", hub_id, failures[hub_id])
            continue
        refs = folder.parent.parent / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        (refs / "main").write_text(revision(hub_id))
        marker.write_text("")
    return failures


ZEN_PROMPT_WORDS = [4, 2, 3, 1, 4, 3, 1, 4, 3, 3, 2, 6, 6, 10, 2, 4, 7, 5, 5]
#: Images per prompt of the multi-image set, cycled: rows with none, one, two and three.
MULTI_IMAGE_COUNTS = [1, 1, 2, 2, 1, 1, 2, 0, 2, 3, 1, 1, 3, 0, 1, 1, 1, 1, 0]
TEST_ROWS = 2  # the last two aphorisms are the test split, as a 10% split of 19 rows


def zen_lines() -> list[str]:
    from trl_standin_tokenizers import corpus

    return [line for line in corpus() if line][1:20]  # the Zen's 19 aphorisms (after its title)


def zen_configs() -> dict[str, dict[str, list]]:
    """The text configs of ``zen``: standard (a prefix of each aphorism) and conversational (a question)."""
    lines = zen_lines()
    prompts = [" ".join(line.split()[:n]) for line, n in zip(lines, ZEN_PROMPT_WORDS)]
    questions = [[{"role": "user", "content": f"How does this line of the Zen of Python end? {p}"}] for p in prompts]
    completions = [line[len(p):] for line, p in zip(lines, prompts)]
    return {"standard_prompt_only": {"prompt": prompts},
            "standard_prompt_completion": {"prompt": prompts, "completion": completions},
            "conversational_prompt_only": {"prompt": questions}}


def images(count: int, seed: int) -> list:
    """``count`` random RGB images of 32-63 pixels a side."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*rng.integers(32, 64, 2), 3), dtype=np.uint8))
            for _ in range(count)]


def write_dataset(folder: Path, configs: dict[str, tuple[dict, object]]) -> None:
    """Write each config's rows (a dict of columns, and their ``datasets.Features``) as train / test parquet
    files with the configs declared in ``README.md``."""
    from datasets import Dataset

    header = ["---", "configs:"]
    for name, (columns, features) in configs.items():
        splits = Dataset.from_dict(columns, features=features).train_test_split(test_size=TEST_ROWS, shuffle=False)
        header += [f"- config_name: {name}", "  data_files:"]
        for split, data in splits.items():
            (folder / name).mkdir(parents=True, exist_ok=True)
            data.to_parquet(str(folder / name / f"{split}-00000-of-00001.parquet"))
            header += [f"  - split: {split}", f"    path: {name}/{split}-*"]
    (folder / "README.md").write_text("\n".join(header + ["---", ""]))


def build_datasets(root: Path) -> dict[str, str]:
    """Write the stand-in datasets under ``root``; returns {hub id: folder}."""
    from datasets import Features, Image, List, Value

    message = [{"content": Value("string"), "role": Value("string")}]
    part = {"text": Value("string"), "type": Value("string")}
    parts_message = List({"content": List(part), "role": Value("string")})
    zen = zen_configs()
    questions = zen["conversational_prompt_only"]["prompt"]
    multi = [[{"role": "user", "content": [{"type": "image", "text": None}] * n + [{"type": "text", "text": q[0]["content"]}]}]
             for q, n in zip(questions, MULTI_IMAGE_COUNTS)]
    sets = {
        f"{ORG}/zen": {name: (columns, None) for name, columns in zen.items()},
        f"{ORG}/zen-image": {"conversational_prompt_only": (
            {"prompt": questions, "image": [images(1, i)[0] for i in range(len(questions))]},
            Features(prompt=message, image=Image()))},
        f"{ORG}/zen-multi-image": {"conversational_prompt_only": (
            {"prompt": multi, "images": [images(n, 100 + i) for i, n in enumerate(MULTI_IMAGE_COUNTS)]},
            Features(prompt=parts_message, images=List(Image())))},
    }
    folders = {}
    for hub_id, configs in sets.items():
        folder = root / f"{STANDIN_VERSION}" / hub_id.replace("/", "--")
        if not (folder / "README.md").exists():
            write_dataset(folder, configs)
        folders[hub_id] = str(folder)
    return folders
