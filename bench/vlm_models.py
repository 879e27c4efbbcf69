"""The vision-language models the VLM benchmarks run: the built-in tiny ones and random-weight ones we did not tune.

``tiny-llava`` / ``tiny-qwen2_5_vl`` are the built-in ``builtin:vlm-*`` models (hidden 64, 2 layers, a
~560-token vocabulary, 16 or 4-16 image tokens). The ``random-*`` models are built the way an outside user
would: a plain ``LlavaConfig`` / ``Qwen2_5_VLConfig`` with transformers' defaults for everything but the sizes
in :data:`RANDOM_VLMS` (text: hidden 512, 8 layers, 8 query / 4 key-value heads (Qwen: 4 / 2, head dim 128),
intermediate 1,376, a 32,000-entry vocabulary; vision: hidden 256, 4 layers, patch 14), random weights from seed 0, with the
built-in family's tokenizer and chat template and an image processor at the tower's patch size. Sampled ids
above the tokenizer's ~560 entries decode to nothing, which the throughput benchmarks do not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Text decoder sizes of the random models (transformers' defaults for the rest).
RANDOM_TEXT = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=1376, vocab_size=32_000)
#: Vision tower sizes of the random models.
RANDOM_VISION = dict(hidden_size=256, intermediate_size=1024, patch_size=14)
#: LLaVA's square input: (112 / 14)^2 = 64 image tokens.
LLAVA_SIDE = 112
#: Qwen2.5-VL's pixel budget: a 112x112 image is (112 / 14 / 2)^2 = 16 tokens (the shapes task's 28x28
#: pictures are upscaled to it).
QWEN_PIXELS = 112 * 112


def _random_llava(tokenizer: Any) -> tuple[Any, Any]:
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    ids = tokenizer.convert_tokens_to_ids
    vision = CLIPVisionConfig(**RANDOM_VISION, num_hidden_layers=4, num_attention_heads=4, image_size=LLAVA_SIDE)
    text = LlamaConfig(**RANDOM_TEXT, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=ids("<image>"),
                         image_seq_length=(LLAVA_SIDE // 14) ** 2)
    model = LlavaForConditionalGeneration(config)
    images = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_SIDE}, crop_size={"height": LLAVA_SIDE, "width": LLAVA_SIDE})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=tokenizer.chat_template)
    return model, processor


def _random_qwen2_5_vl(tokenizer: Any) -> tuple[Any, Any]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from grpo_ascend.models.tiny_vlm_processors import image_only_qwen2_5_vl_processor

    ids = tokenizer.convert_tokens_to_ids
    # 4 query / 2 key-value heads: head dim 128, as Qwen2.5-VL's, which its default mrope sections (16, 24, 24) need
    text = {**RANDOM_TEXT, "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    vision = {**RANDOM_VISION, "depth": 4, "num_heads": 4, "out_hidden_size": RANDOM_TEXT["hidden_size"]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                              video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                              vision_end_token_id=ids("<|vision_end|>"))
    model = Qwen2_5_VLForConditionalGeneration(config)
    images = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=QWEN_PIXELS,
                                      max_pixels=QWEN_PIXELS)
    processor = image_only_qwen2_5_vl_processor()(image_processor=images, tokenizer=tokenizer,
                                                  chat_template=tokenizer.chat_template)
    return model, processor


#: Random-weight models by name: (family of the tokenizer and chat template, builder).
RANDOM_VLMS = {"random-llava-32k": ("llava", _random_llava), "random-qwen2_5_vl-32k": ("qwen2_5_vl", _random_qwen2_5_vl)}
TINY_VLMS = {"tiny-llava": "llava", "tiny-qwen2_5_vl": "qwen2_5_vl"}
MODELS = (*TINY_VLMS, *RANDOM_VLMS)


def build_vlm(name: str) -> tuple[Any, Any]:
    """(fp32 model in eval mode, processor) of ``name`` (a key of :data:`TINY_VLMS` or :data:`RANDOM_VLMS`)."""
    import torch

    from grpo_ascend.models.seeding import seeded
    from grpo_ascend.models.tiny_vlm import FAMILIES, build_vlm_parts
    from grpo_ascend.models.tiny_vlm_processors import vlm_tokenizer

    if name in TINY_VLMS:
        return build_vlm_parts(TINY_VLMS[name])
    if name not in RANDOM_VLMS:
        raise SystemExit(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    family, build = RANDOM_VLMS[name]
    spec = FAMILIES[family]
    tokenizer = vlm_tokenizer(spec.image_tokens, spec.chat_template, seed=0)
    with seeded(0):
        model, processor = build(tokenizer)
    model = model.to(torch.float32).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, processor


def vlm_folder(name: str) -> Path:
    """A folder holding ``name``'s model and processor (built-in: its cache; random: built once into the cache)."""
    from grpo_ascend.models.build_cache import cache_dir
    from grpo_ascend.models.tiny_vlm import build_tiny_vlm

    if name in TINY_VLMS:
        return build_tiny_vlm(TINY_VLMS[name])
    target = cache_dir() / f"{name}-s0"
    if not (target / "config.json").exists():
        model, processor = build_vlm(name)
        tmp = target.with_name(target.name + ".tmp")
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        tmp.rename(target)
    return target
