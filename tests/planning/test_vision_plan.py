"""The memory plan of a vision-language run (planning/vision_shape.py, vision_terms.py): the vision tower's and
projector's parameters against a direct count of built models (tiny, and real shapes on the meta device), the
image tokens and pixel elements against what the processor returns, the terms' arithmetic, and the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from grpo_ascend.cli import main
from grpo_ascend.distributed.memory_layout import plain_layout
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.tiny_vlm import build_tiny_vlm, build_vlm_parts
from grpo_ascend.planning.memory_plan import RunSettings, load_model_shape, plan_memory
from grpo_ascend.planning.shape import vision_language_shape

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "model_configs"
#: Where each family keeps its projector (the rest outside the language model and head is the tower).
PROJECTOR = {"qwen2_5_vl": ".merger.", "llava": ".multi_modal_projector."}
#: llava-hf/llava-1.5-7b-hf's config.json: the text config leaves Llama's defaults (hidden 4096, 32 layers) out.
LLAVA_1_5_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
    "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False, "torch_dtype": "float16",
    "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                    "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def direct_counts(model: torch.nn.Module, family: str) -> tuple[int, int, int]:
    """(text decoder + head, vision tower, projector) parameters of a built model, each tensor once."""
    text = tower = projector = 0
    for name, param in model.named_parameters():  # tied weights are listed once
        name = f".{name}."
        if ".language_model." in name or ".lm_head." in name:
            text += param.numel()
        elif PROJECTOR[family] in name:
            projector += param.numel()
        else:
            tower += param.numel()
    return text, tower, projector


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_builtin_vlm_shape_counts_what_the_built_model_holds(family):
    model, _ = build_vlm_parts(family)
    shape = load_model_shape(f"builtin:vlm-{family}")
    assert (shape.num_params, shape.vision.tower_params, shape.vision.projector_params) == direct_counts(model, family)
    assert shape == load_model_shape(str(build_tiny_vlm(family)))  # the built folder reads the same


@pytest.mark.parametrize("family, raw", [("qwen2_5_vl", json.loads((CONFIGS / "qwen2.5-vl-7b.json").read_text())),
                                         ("llava", LLAVA_1_5_7B)])
def test_real_shapes_match_the_model_built_on_the_meta_device(family, raw):
    from transformers import AutoConfig, AutoModelForImageTextToText

    fields = {k: v for k, v in raw.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(raw["model_type"], **fields))
    shape = vision_language_shape(raw, family)
    assert (shape.num_params, shape.vision.tower_params, shape.vision.projector_params) == direct_counts(model, family)
    published = {"qwen2_5_vl": 8.29, "llava": 7.06}[family]  # billions, as the model cards give them
    assert round((shape.num_params + shape.vision.num_params) / 1e9, 2) == published


@pytest.mark.parametrize("family, size", [("qwen2_5_vl", (28, 28)), ("qwen2_5_vl", (40, 30)),
                                          ("qwen2_5_vl", (300, 200)), ("llava", (40, 30))])
def test_image_tokens_and_pixels_are_what_the_processor_returns(family, size):
    folder = build_tiny_vlm(family)
    from grpo_ascend.models.vision_language import load_processor

    processor = load_processor(folder)
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                         tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], images=[Image.new("RGB", size)], return_tensors="pt")
    cost = load_model_shape(str(folder), image_size=size).vision.image
    assert cost.tokens == int((out["input_ids"] == image_token).sum())
    assert cost.pixel_elements == out["pixel_values"].numel()


def test_vision_terms_are_the_spelled_out_arithmetic():
    """Qwen2.5-VL-7B, LoRA, bf16, 2 prompts x G=8 with 2 images of 448x448, micro-batches of 8 rows."""
    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct", image_size=(448, 448))
    v = shape.vision
    assert (v.image.tokens, v.image.patches, v.image.pixel_elements) == (256, 1024, 1024 * 3 * 2 * 14 * 14)
    s = RunSettings(weight_bytes=2, activation_bytes=2, prompts_per_rank=2, num_generations=8, prompt_length=600,
                    completion_length=256, micro_batch_rows=8, rows_per_step=16, images_per_prompt=2)
    plan = plan_memory(shape, s, plain_layout(1))
    terms = {(t.name, t.phases): t.nbytes for t in plan.terms}
    everywhere = ("generation", "old_logprobs", "reference", "values", "training")
    assert terms[("vision tower + projector", everywhere)] == (631_975_680 + 44_574_464) * 2
    assert terms[("pixel tensors", ("generation",))] == 2 * 2 * v.image.pixel_elements * 4  # 2 prompts' images
    assert terms[("pixel tensors", ("training",))] == 1 * 2 * v.image.pixel_elements * 4  # 8 rows: one prompt
    assert terms[("vision forward", ("training",))] == 2 * 1024 * (5 * 1280 + 3 * 3420) * 2
    text_only = plan_memory(shape, RunSettings(**{**s.__dict__, "images_per_prompt": 0}), plain_layout(1))
    assert {t.name for t in plan.terms} - {t.name for t in text_only.terms} == {"pixel tensors", "vision forward"}
    no_vision = plan_memory(load_model_shape("x", CONFIGS / "qwen2.5-7b.json"), s, plain_layout(1))
    assert not any("vision" in t.name or "pixel" in t.name for t in no_vision.terms)  # text models: as before


def test_unplanned_families_and_bad_sizes_say_what_is_known(capsys):
    with pytest.raises(ConfigError, match=r"model_type 'gemma4' cannot be planned yet; planned families: \['gemma3', "):
        vision_language_shape({"model_type": "gemma4", "vision_config": {}}, "cfg")
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "default.yaml")
    assert main(["plan", recipe, "--model", "builtin:vlm-llava", "--image-size", "big"]) != 0
    assert "--image-size 'big' is not a size" in capsys.readouterr().err
    assert main(["plan", recipe, "--device", "cpu", "--images-per-prompt", "1"]) != 0
    assert "--images-per-prompt is for vision-language models" in capsys.readouterr().err


def test_plan_command_on_a_built_vlm_folder(capsys):
    folder = build_tiny_vlm("qwen2_5_vl")
    root = Path(__file__).resolve().parents[2]
    code = main(["plan", str(root / "recipes" / "default.yaml"), "--model", str(folder), "--device", "cpu",
                 "--prompt-length", "20", "--image-size", "28x28", "--images-per-prompt", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "vision: qwen2_5_vl tower 30,592 + projector 24,800 parameters; 2 image(s) per prompt, 4 tokens" in out
    assert "vision: tower and projector frozen (train_vision_parts: [])" in out
    assert "prompt: 20 text tokens (--prompt-length) + 8 image tokens" in out
    assert "prompt 28 + completion" in out and "vision tower + projector" in out and "pixel tensors" in out


def test_trainer_auto_budget_plans_a_vision_language_model(monkeypatch):
    """max_tokens_per_micro_batch: auto with builtin:vlm-llava: the trainer plans its loaded config with the
    vision part and one image per prompt (the LoRA regex on the language model counts as every linear)."""
    from grpo_ascend import device as dev
    from grpo_ascend.config.configs import GRPOConfig
    from grpo_ascend.models.policy import default_lora_config
    from grpo_ascend.planning.memory_plan import AUTO_FRACTION, auto_token_budget, lora_targets, run_settings
    from grpo_ascend.trainers.grpo import GRPOTrainer
    from grpo_ascend.vision.shapes_task import colour_code_reward, coloured_shapes_dataset

    shape = load_model_shape("builtin:vlm-llava")
    args = GRPOConfig(max_tokens_per_micro_batch="auto", num_generations=4, per_device_train_batch_size=4,
                      gradient_accumulation_steps=4, max_completion_length=64, max_prompt_length=96,
                      rollout_merge_lora=False, report_to=[], disable_tqdm=True, max_steps=1)
    settings = run_settings(args, "cpu", 1, algorithm="grpo", use_peft=True, lora_r=8, lora_targets=None,
                            weight_bytes=4, precision="fp32")
    settings = RunSettings(**{**settings.__dict__, "images_per_prompt": 1})
    assert lora_targets(r".*\.language_model\..*\.(down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)") is None
    three, four = (plan_memory(shape, settings, plain_layout(1), rows=r).peak_bytes for r in (3, 4))
    free = int((three + four) / 2 / AUTO_FRACTION)
    monkeypatch.setattr(dev, "free_memory", lambda device: (free, free))
    monkeypatch.setattr(dev, "memory_stats", lambda device: {"allocated": 0, "reserved": 0, "peak": 0})
    trainer = GRPOTrainer("builtin:vlm-llava", colour_code_reward, args, coloured_shapes_dataset(8),
                          peft_config=default_lora_config(8, 16))
    assert trainer.token_budget == auto_token_budget(shape, settings, plain_layout(1), int(free * AUTO_FRACTION))
    assert trainer.token_budget == 3 * 64 + 1 * 96
