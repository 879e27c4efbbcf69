"""Offline, deterministic tiny vision-language models: Qwen2.5-VL, Qwen3.5 (dense and MoE: a hybrid linear- and
full-attention text decoder), LLaVA-1.5, LLaVA-NeXT and Gemma 4 architectures in miniature.

Vision-language GRPO (issue #38) needs real ``*ForConditionalGeneration`` models with working processors and
chat templates, without any download. Each family in :data:`FAMILIES` builds its model from a fixed seed and
its processor around the tiny BPE tokenizer (:mod:`grpo_ascend.models.tiny_vlm_processors`), and saves both
with ``save_pretrained``; the folder loads with ``AutoModelForImageTextToText`` and ``AutoProcessor`` (or
:func:`~grpo_ascend.models.tiny_vlm_processors.load_vlm_processor` where torchvision is missing). Builds are
cached per family, seed and version. Images are small (28 to 56 pixels a side): a picture is 4 to 16 tokens.
``builtin:vlm-<family>-warm`` adds a short supervised warm start on the coloured-shapes task
(:mod:`grpo_ascend.models.tiny_vlm_warm`), so GRPO on that task has signal.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo_ascend.errors import ConfigError, closest
from grpo_ascend.models.build_cache import build_lock, cache_dir, write_atomically
from grpo_ascend.models.seeding import seeded
from grpo_ascend.models.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN
from grpo_ascend.models.tiny_vlm_processors import (
    GEMMA4_CHAT_TEMPLATE,
    GEMMA4_NAMED_TOKENS,
    GEMMA4_TOKENS,
    LLAVA_CHAT_TEMPLATE,
    LLAVA_TOKENS,
    QWEN2_5_VL_CHAT_TEMPLATE,
    QWEN_VL_TOKENS,
    image_only_processor,
    vlm_tokenizer,
)
from grpo_ascend.models.tiny_vlm_warm import vlm_warm_start

logger = logging.getLogger(__name__)

#: Bumped whenever a build's files change; part of the cache folder's name.
VLM_BUILD_VERSION = 1
#: The ``-warm`` builds' own version (their cache folder is ``vlm-<family>-warm-s<seed>-v1.<this>``).
VLM_WARM_VERSION = 1
#: Built-in flavours: ``builtin:vlm-<family>`` (random weights) and ``builtin:vlm-<family>-warm``.
VLM_FLAVOURS = ("", "warm")
#: The text decoder of every family: 2 layers, hidden 64, 4 query heads over 2 key/value heads (head dim 16).
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048}
#: The text decoder's head dimensions a build may choose: 16 (the default), or 32 (2 query heads over 1 key/value
#: head), the smallest vLLM's CPU attention runs (docs/vlm.md#vllm).
HEAD_DIMS = (16, 32)
#: Vision patch side in pixels; Qwen2.5-VL merges 2x2 patches into one token.
PATCH = 7
#: LLaVA's square input side (its CLIP tower's image_size): (28 / 7)^2 = 16 image tokens.
LLAVA_IMAGE = 28
#: Qwen2.5-VL's pixel budget per image: 28x28 (4 tokens) to 56x56 (16 tokens).
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 28 * 28, 56 * 56


@dataclass(frozen=True)
class VLMFamily:
    """One built-in vision-language family: its image tokens, chat template, model and processor
    (``named_tokens``: special tokens its processor reads from the tokenizer by name)."""

    image_tokens: list[str]
    chat_template: str
    build_model: Callable  # (tokenizer, seed, text) -> a PreTrainedModel
    build_processor: Callable  # (tokenizer) -> a ProcessorMixin
    named_tokens: dict[str, str] | None = None


def _special_ids(tokenizer) -> dict:
    """The text config's special ids: no BOS, the ChatML end of turn as EOS, <|endoftext|> as padding."""
    return {"bos_token_id": None, "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
            "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN)}


def _text_config(head_dim: int) -> dict:
    """:data:`TEXT` with ``head_dim`` per attention head (the hidden size stays 64)."""
    if head_dim not in HEAD_DIMS:
        raise ConfigError(f"head_dim={head_dim} is not a tiny vision-language build's; choose one of {HEAD_DIMS}")
    heads = TEXT["hidden_size"] // head_dim
    return {**TEXT, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2)}


def _qwen2_5_vl_model(tokenizer, seed: int, text: dict):
    """Qwen2.5-VL: a 2-block vision tower with window attention in block 0 (a 56x56 image is 2x2 windows of
    2x2 merged patches) and full attention in block 1, then the 2-layer text decoder with 3D (mrope) positions."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    config = Qwen2_5_VLConfig(
        text_config={**text, "vocab_size": len(tokenizer), **_special_ids(tokenizer),
                     # temporal, height, width sections of the rotary half-dimension: head dim 16 / 2 = 2 + 3 + 3
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0,
                                         "mrope_section": [s * head_dim // 16 for s in (2, 3, 3)]}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "patch_size": PATCH, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 4 * PATCH, "fullatt_block_indexes": [1],
                       "out_hidden_size": TEXT["hidden_size"]},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    with seeded(seed):
        return Qwen2_5_VLForConditionalGeneration(config)


def _qwen_vision_ids(tokenizer) -> dict:
    ids = tokenizer.convert_tokens_to_ids
    return {"image_token_id": ids("<|image_pad|>"), "video_token_id": ids("<|video_pad|>"),
            "vision_start_token_id": ids("<|vision_start|>"), "vision_end_token_id": ids("<|vision_end|>")}


#: Qwen3.5 MoE's text settings in miniature: 4 experts, 2 per token, and a shared expert.
QWEN3_5_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32}


def qwen3_5_config(tokenizer, text: dict, moe: bool = False):
    """A Qwen3.5 config (``moe``: Qwen3.5 MoE's) on ``tokenizer`` with the text decoder ``text``: a 2-block vision
    tower (learned position embeddings, 2x2 patch merger) and a hybrid decoder, a gated-DeltaNet linear-attention
    layer then a full-attention layer, with interleaved 3D (mrope) rotary positions on half of each head."""
    import transformers

    head_dim = text["hidden_size"] // text["num_attention_heads"]
    decoder = {**text, "head_dim": head_dim, "vocab_size": len(tokenizer), **_special_ids(tokenizer),
               "layer_types": ["linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
               "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4,
               # temporal, height, width sections of half the rotary dimension (head_dim / 2 rotated)
               "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5,
                                   "mrope_section": [s * head_dim // 16 for s in (2, 1, 1)],
                                   "mrope_interleaved": True},
               **(QWEN3_5_MOE if moe else {})}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": text["hidden_size"],
              "num_position_embeddings": 64}
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return config_class(text_config=decoder, vision_config=vision, tie_word_embeddings=True,
                        **_qwen_vision_ids(tokenizer))


def _qwen3_5_model_of(moe: bool) -> Callable:
    def build(tokenizer, seed: int, text: dict):
        import transformers

        model_class = (transformers.Qwen3_5MoeForConditionalGeneration if moe
                       else transformers.Qwen3_5ForConditionalGeneration)
        with seeded(seed):
            return model_class(qwen3_5_config(tokenizer, text, moe))

    return build


def qwen_vl_processor(tokenizer, processor_class: str = "Qwen2_5_VLProcessor"):
    """An image-only Qwen-VL processor (:func:`image_only_processor` of ``processor_class``; PIL image processor,
    no torchvision needed) at the tiny patch size: 28x28 to 56x56 pixels, 4 to 16 image tokens."""
    from transformers import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=2, temporal_patch_size=2,
                                      min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS)
    return image_only_processor(processor_class)(image_processor=images, tokenizer=tokenizer,
                                                 chat_template=tokenizer.chat_template)


def _llava_towers(tokenizer, text: dict) -> tuple:
    """LLaVA's vision tower and text decoder configs: a 2-layer CLIP tower, a 2-layer Llama decoder."""
    from transformers import CLIPVisionConfig, LlamaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=LLAVA_IMAGE, patch_size=PATCH, projection_dim=32)
    return vision, LlamaConfig(**text, vocab_size=len(tokenizer), **_special_ids(tokenizer), tie_word_embeddings=True)


def _llava_model(tokenizer, seed: int, text: dict):
    """LLaVA-1.5: a 2-layer CLIP vision tower (features of its second-to-last layer, CLS dropped), a 2-layer
    GELU projector, and a 2-layer Llama text decoder."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    vision, decoder = _llava_towers(tokenizer, text)
    config = LlavaConfig(vision_config=vision, text_config=decoder,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=(LLAVA_IMAGE // PATCH) ** 2, vision_feature_select_strategy="default",
                         vision_feature_layer=-2, projector_hidden_act="gelu", tie_word_embeddings=True)
    with seeded(seed):
        return LlavaForConditionalGeneration(config)


def _llava_processor(tokenizer):
    """LlavaProcessor with a PIL CLIP image processor (resize and centre crop to 28x28): one image, 16 tokens."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    images = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE},
                                   crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=tokenizer.chat_template)


#: LLaVA-NeXT's tilings (height, width): a picture is resized onto the best fitting one and cut into 28x28 tiles.
LLAVA_NEXT_GRID = [[LLAVA_IMAGE, LLAVA_IMAGE], [LLAVA_IMAGE, 2 * LLAVA_IMAGE], [2 * LLAVA_IMAGE, LLAVA_IMAGE]]


def _llava_next_model(tokenizer, seed: int, text: dict):
    """LLaVA-NeXT: LLaVA-1.5's tower, projector and decoder, plus tiling ("anyres": a base view and the tiles of
    the best fitting grid, unpadded to the picture's aspect ratio, with a learned newline feature per row)."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    vision, decoder = _llava_towers(tokenizer, text)
    config = LlavaNextConfig(vision_config=vision, text_config=decoder,
                             image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=LLAVA_NEXT_GRID,
                             vision_feature_select_strategy="default", vision_feature_layer=-2,
                             projector_hidden_act="gelu", tie_word_embeddings=True)
    with seeded(seed):
        return LlavaNextForConditionalGeneration(config)


def _llava_next_processor(tokenizer):
    """LlavaNextProcessor with a PIL image processor tiling onto :data:`LLAVA_NEXT_GRID`; it counts the tower's
    CLS token before the "default" strategy drops it (``num_additional_image_tokens=1``), as the real ones."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    images = LlavaNextImageProcessorPil(size={"shortest_edge": LLAVA_IMAGE},
                                        crop_size={"height": LLAVA_IMAGE, "width": LLAVA_IMAGE},
                                        image_grid_pinpoints=LLAVA_NEXT_GRID)
    return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=tokenizer.chat_template)


def _gemma4_model(tokenizer, seed: int, text: dict):
    """Gemma 4 without its audio tower: a 2-layer vision encoder (7-pixel patches pooled 2x2, at most 70 soft
    tokens a picture), a sliding-window then a full-attention text layer with per-layer inputs."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    named = {key.removesuffix("_token"): ids(token) for key, token in GEMMA4_NAMED_TOKENS.items()}
    config = Gemma4Config(
        text_config={**text, "head_dim": head_dim, "global_head_dim": head_dim, "vocab_size": len(tokenizer),
                     **_special_ids(tokenizer), "sliding_window": 64,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "vocab_size_per_layer_input": len(tokenizer), "hidden_size_per_layer_input": 8},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "head_dim": 16, "patch_size": PATCH, "pooling_kernel_size": 2,
                       "position_embedding_size": 64},
        audio_config=None, boi_token_id=named["boi"], eoi_token_id=named["eoi"], image_token_id=named["image"],
        video_token_id=ids("<|video|>"), boa_token_id=named["boa"], eoa_token_index=named["eoa"],
        audio_token_id=named["audio"], tie_word_embeddings=True)
    with seeded(seed):
        return Gemma4ForConditionalGeneration(config)


def _gemma4_processor(tokenizer):
    """Gemma 4's processor without its video part (image-only; its audio feature extractor kept), PIL images."""
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil

    images = Gemma4ImageProcessorPil(patch_size=PATCH, max_soft_tokens=70, pooling_kernel_size=2)
    return image_only_processor("Gemma4Processor")(
        feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images, tokenizer=tokenizer,
        chat_template=tokenizer.chat_template, image_seq_length=70)


FAMILIES: dict[str, VLMFamily] = {
    "qwen2_5_vl": VLMFamily(QWEN_VL_TOKENS, QWEN2_5_VL_CHAT_TEMPLATE, _qwen2_5_vl_model, qwen_vl_processor),
    "llava": VLMFamily(LLAVA_TOKENS, LLAVA_CHAT_TEMPLATE, _llava_model, _llava_processor),
    "llava_next": VLMFamily(LLAVA_TOKENS, LLAVA_CHAT_TEMPLATE, _llava_next_model, _llava_next_processor),
    "gemma4": VLMFamily(GEMMA4_TOKENS, GEMMA4_CHAT_TEMPLATE, _gemma4_model, _gemma4_processor, GEMMA4_NAMED_TOKENS),
    "qwen3_5": VLMFamily(QWEN_VL_TOKENS, QWEN2_5_VL_CHAT_TEMPLATE, _qwen3_5_model_of(moe=False),
                         lambda tokenizer: qwen_vl_processor(tokenizer, "Qwen3VLProcessor")),
    "qwen3_5_moe": VLMFamily(QWEN_VL_TOKENS, QWEN2_5_VL_CHAT_TEMPLATE, _qwen3_5_model_of(moe=True),
                             lambda tokenizer: qwen_vl_processor(tokenizer, "Qwen3VLProcessor")),
}


def _family(family: str) -> VLMFamily:
    if family not in FAMILIES:
        raise ConfigError(f"unknown vision-language family {family!r}; expected one of {sorted(FAMILIES)}"
                          f"{closest(family, FAMILIES)}")
    return FAMILIES[family]


def vlm_build_name(family: str, seed: int = 0, warm: bool = False, head_dim: int = HEAD_DIMS[0]) -> str:
    """The cache folder name of a built-in vision-language model (``-hd32`` for a non-default head dimension)."""
    name = f"{family}-hd{head_dim}" if head_dim != HEAD_DIMS[0] else family
    if warm:
        return f"vlm-{name}-warm-s{seed}-v{VLM_BUILD_VERSION}.{VLM_WARM_VERSION}"
    return f"vlm-{name}-s{seed}-v{VLM_BUILD_VERSION}"


def build_vlm_parts(family: str, seed: int = 0, warm: bool = False, head_dim: int = HEAD_DIMS[0]):
    """(model, processor) of ``family`` in memory, in eval mode: what :func:`build_tiny_vlm` saves; ``warm``
    adds the coloured-shapes warm start; ``head_dim``: the text decoder's, one of :data:`HEAD_DIMS`."""
    import torch

    spec = _family(family)
    tokenizer = vlm_tokenizer(spec.image_tokens, spec.chat_template, seed=seed, named=spec.named_tokens)
    model = spec.build_model(tokenizer, seed, _text_config(head_dim)).to(torch.float32).eval()
    special = _special_ids(tokenizer)
    for key, value in special.items():
        setattr(model.generation_config, key, value)
    processor = spec.build_processor(tokenizer)
    if warm:
        logger.info("building %s: supervised warm start on coloured shapes (seconds of CPU)",
                    vlm_build_name(family, seed, warm, head_dim))
        vlm_warm_start(model, processor, seed=seed)
    return model.eval(), processor


def build_tiny_vlm(family: str, seed: int = 0, out_dir: str | os.PathLike | None = None,
                   force: bool = False, warm: bool = False, head_dim: int = HEAD_DIMS[0]) -> Path:
    """Build (or reuse from the cache) a built-in vision-language model + processor and return its folder.

    ``family`` is a key of :data:`FAMILIES`; the same ``seed`` gives the same weights and files (``warm``: on the
    same machine). The folder loads with ``AutoModelForImageTextToText.from_pretrained`` and
    ``AutoProcessor.from_pretrained``. ``head_dim=32`` builds a decoder vLLM's CPU attention can run.
    """
    _family(family)
    _text_config(head_dim)
    target = Path(out_dir) if out_dir is not None else cache_dir() / vlm_build_name(family, seed, warm, head_dim)
    if not force and _is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(target):
        if not force and _is_built(target):
            return target  # another process built it while this one waited

        def write(tmp: Path) -> None:
            model, processor = build_vlm_parts(family, seed, warm, head_dim)
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)

        logger.info("building %s", target.name)
        return write_atomically(target, write)


def _is_built(target: Path) -> bool:
    return all((target / name).exists() for name in ("config.json", "model.safetensors", "processor_config.json"))


def resolve_builtin_vlm(name: str) -> Path:
    """``builtin:vlm-<family>[-warm]`` (the part after ``vlm-``) to its built folder."""
    family, _, flavour = name.partition("-")
    if family not in FAMILIES or flavour not in VLM_FLAVOURS:
        raise ConfigError(f"unknown built-in model 'builtin:vlm-{name}': expected builtin:vlm-<family>[-warm], family "
                          f"in {sorted(FAMILIES)}{closest(family, FAMILIES)}")
    return build_tiny_vlm(family, warm=flavour == "warm")


def add_build_arguments(parser) -> None:
    """Arguments of ``grpo-ascend build-tiny-vlm``."""
    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(FAMILIES),
                        help="architecture family (default qwen2_5_vl)")
    parser.add_argument("--out", default=None, help="folder to write (default: the cache, reused if present)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokenizer, weights and warm start")
    parser.add_argument("--warm", action="store_true", help="add the supervised warm start on the coloured-shapes task")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIMS[0], choices=HEAD_DIMS,
                        help="the text decoder's head dimension (32: servable by vLLM's CPU build)")


def run_build(ns) -> int:
    """``grpo-ascend build-tiny-vlm``: build (or find) a built-in vision-language model and print its folder."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_tiny_vlm(ns.family, seed=ns.seed, out_dir=ns.out, force=ns.force, warm=ns.warm, head_dim=ns.head_dim))
    return 0
