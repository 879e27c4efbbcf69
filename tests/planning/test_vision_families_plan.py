"""The memory plan's vision families beyond Qwen2.5-VL and LLaVA (planning/vision_qwen.py, vision_clip.py):
Qwen2-VL, Qwen3-VL, Qwen3.5, LLaVA-NeXT and Gemma 3. Each family's tower and projector parameters and linear
layers against the model built on the meta device at its published default size, and its image tokens and
pixel elements against what the family's processor returns for pictures of several sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from grpo_ascend.models.tiny_vlm import build_tiny_vlm
from grpo_ascend.models.vision_language import VISION_PARTS, load_processor
from grpo_ascend.planning.memory_plan import load_model_shape
from grpo_ascend.planning.shape import vision_language_shape

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
BENCH = Path(__file__).resolve().parents[2] / "bench"

#: Configs as the hub's checkpoints of each family write them (defaults filled in by transformers).
REAL = {
    "qwen2_vl": {"model_type": "qwen2_vl"},  # transformers' defaults: Qwen2-VL-7B
    "qwen3_vl": {"model_type": "qwen3_vl"},  # Qwen3-VL-8B's vision tower with three deepstack mergers
    "qwen3_5": {"model_type": "qwen3_5"},
    "llava_next": {"model_type": "llava_next"},  # llava-v1.6 on a CLIP ViT-L/14-336
    # gemma-3-4b-it: a SigLIP tower without its pooling head, 256 tokens per image
    "gemma3": {"model_type": "gemma3", "mm_tokens_per_image": 256,
               "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34},
               "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                 "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                 "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}},
    "gemma3-head": {"model_type": "gemma3"},  # SigLIP with its attention-pooling head (transformers' default)
}


def part_of(name: str) -> str | None:
    """'projector' / 'vision_tower' / None (the language model and head), as train_vision_parts names them."""
    dotted = f".{name}."
    if ".language_model." in dotted or "lm_head" in name:
        return None
    return "projector" if any(piece in dotted for piece in VISION_PARTS["projector"]) else "vision_tower"


def measured_parts(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Per part: (parameters, LoRA elements per rank, linear weights) of the built model, each tensor once."""
    out = {"projector": [0, 0, 0], "vision_tower": [0, 0, 0]}
    for name, param in model.named_parameters():
        if part_of(name):
            out[part_of(name)][0] += param.numel()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and part_of(name):
            out[part_of(name)][1] += module.in_features + module.out_features
            out[part_of(name)][2] += module.in_features * module.out_features
    return {k: tuple(v) for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(REAL))
def test_family_parts_match_the_model_built_on_the_meta_device(name):
    from transformers import AutoConfig, AutoModelForImageTextToText

    raw = REAL[name]
    config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    v = vision_language_shape(config.to_dict(), name).vision
    planned = {p: (v.part(p).params, v.part(p).lora_params(1), v.part(p).linear_weights)
               for p in ("projector", "vision_tower")}
    assert planned == measured_parts(model)


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """Gemma 3 and Qwen2-VL folders as bench/trl_standin_models.py builds them (model and processor)."""
    sys.path.insert(0, str(BENCH))
    import trl_standin_models
    from trl_standin_tokenizers import build_tokenizer

    folders = {}
    for family, build, tokens in (("gemma3", trl_standin_models.gemma3, "gemma3"),
                                  ("qwen2_vl", trl_standin_models.qwen2_vl, "qwen2_5_vl")):
        folders[family] = tmp_path_factory.mktemp(family)
        build(build_tokenizer(tokens), folders[family])
    return folders


def folder_of(family: str, standins: dict[str, Path]) -> Path:
    return standins[family] if family in standins else build_tiny_vlm(family)


@pytest.mark.parametrize("family, sizes", [
    ("llava_next", [(28, 28), (56, 28), (28, 56), (40, 30), (100, 30), (30, 90)]),
    ("qwen3_5", [(28, 28), (40, 30), (300, 200)]),
    ("qwen2_vl", [(28, 28), (40, 30), (300, 200)]),
    ("gemma3", [(28, 28), (40, 30)]),
])
def test_image_tokens_and_pixels_are_what_the_family_processor_returns(family, sizes, standins):
    from transformers import AutoConfig

    folder = folder_of(family, standins)
    processor = load_processor(folder)
    config = AutoConfig.from_pretrained(folder)
    image_token = getattr(config, "image_token_id", None) or config.image_token_index
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                         tokenize=False, add_generation_prompt=True)
    for size in sizes:
        out = processor(text=[text], images=[Image.new("RGB", size)], return_tensors="pt")
        cost = load_model_shape(str(folder), image_size=size).vision.image
        assert (cost.tokens, cost.pixel_elements) == (int((out["input_ids"] == image_token).sum()),
                                                      out["pixel_values"].numel()), (family, size)


def test_llava_next_without_a_size_plans_the_pinpoint_of_most_tokens():
    """No --image-size: LLaVA-NeXT's largest grid (two 28x28 tiles of 16 patches and the base view)."""
    cost = load_model_shape("builtin:vlm-llava_next").vision.image
    assert cost.pixel_elements == 3 * 3 * 28 * 28 and cost.patches == 3 * (16 + 1)
    assert cost.tokens == max(load_model_shape("builtin:vlm-llava_next", image_size=s).vision.image.tokens
                              for s in ((28, 28), (28, 56), (56, 28)))
