"""``train_vision_parts`` in the memory plan (planning/vision_terms.py): the trainable elements it plans per part
equal what build_policy leaves requires_grad for each setting under LoRA and full fine-tuning, the trained parts'
gradients and optimizer state are counted as the decoder's, and the training forward keeps the tower's and the
projector's activations exactly when they train (the no-grad forwards never do)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_ascend.config.configs import GRPOConfig
from grpo_ascend.distributed.memory_layout import plain_layout
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.models.tiny_vlm import build_tiny_vlm
from grpo_ascend.models.vision_language import VISION_PARTS
from grpo_ascend.planning.memory_plan import RunSettings, load_model_shape, plan_memory, run_settings
from grpo_ascend.planning.shape import vision_language_shape
from grpo_ascend.planning.vision_terms import trained_vision_params
from grpo_ascend.trainers.components import build_policy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
SETTINGS = [[], ["projector"], ["vision_tower"], ["projector", "vision_tower"], None]


def is_vision(name: str) -> bool:
    dotted = f".{name}."
    return ".language_model." not in dotted and "lm_head" not in name and any(
        piece in dotted for pieces in VISION_PARTS.values() for piece in pieces)


@pytest.mark.parametrize("peft", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe"])
def test_planned_trainable_elements_are_what_build_policy_leaves_trainable(tmp_path, family, peft):
    folder = str(build_tiny_vlm(family))
    shape = load_model_shape(folder)
    for parts in SETTINGS:
        args = GRPOConfig(output_dir=str(tmp_path), report_to=[], train_vision_parts=parts)
        policy, _ = build_policy(folder, None, default_lora_config(r=4) if peft else None, args, torch.device("cpu"))
        trained = {n: p.numel() for n, p in policy.named_parameters() if p.requires_grad}
        vision = sum(k for n, k in trained.items() if is_vision(n))
        s = run_settings(args, "cpu", 1, algorithm="grpo", use_peft=peft, lora_r=4, lora_targets=None,
                         weight_bytes=4, precision="fp32")
        assert s.train_vision_parts == (None if parts is None else tuple(parts))
        assert trained_vision_params(shape.vision, s) == vision, (family, peft, parts)
        if not family.startswith("qwen3_5"):  # the plan's decoder is a Llama / Qwen2 one; Qwen3.5's is hybrid
            decoder = shape.lora_params(4, None) if peft else shape.num_params
            assert sum(trained.values()) - vision == decoder, (family, peft, parts)


def test_trained_parts_are_counted_as_the_decoders_weights():
    """Qwen2.5-VL-7B, bf16 weights: full fine-tuning of every part (null) adds the vision weights to the
    gradients and Adam moments; LoRA on the tower adds its adapters (tower and the merger inside it)."""
    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct", image_size=(448, 448))
    v, m = shape.vision, shape
    base = RunSettings(use_peft=False, weight_bytes=2, activation_bytes=2, prompts_per_rank=2, num_generations=8,
                       prompt_length=600, completion_length=256, micro_batch_rows=8, rows_per_step=16,
                       images_per_prompt=2)

    def terms(**changes):
        return {t.name: t.nbytes for t in plan_memory(shape, dataclasses.replace(base, **changes), plain_layout(1)).terms}

    frozen, whole = terms(), terms(train_vision_parts=None)
    assert frozen["gradients"] == m.num_params * 2 and whole["gradients"] == (m.num_params + v.num_params) * 2
    assert whole["optimizer state"] - frozen["optimizer state"] == v.num_params * 2 * 2
    projector = terms(train_vision_parts=("projector",))
    assert projector["gradients"] - frozen["gradients"] == v.projector_params * 2 == 44_574_464 * 2
    lora = terms(use_peft=True, train_vision_parts=("vision_tower",))
    plain = terms(use_peft=True)
    adapters = 16 * sum(x.count * (x.in_features + x.out_features) for p in (v.tower, v.projector) for x in p.linears)
    assert lora["LoRA parameters"] - plain["LoRA parameters"] == adapters * 4
    assert lora["gradients"] - plain["gradients"] == adapters * 4 and terms(use_peft=True, train_vision_parts=None) == plain


def test_training_keeps_the_vision_activations_of_what_trains():
    """Every vision layer's saved tensors when the tower trains (its layer inputs under checkpointing), the
    projector's alone when only it trains, nothing when neither does; no-grad forwards keep nothing."""
    shape = load_model_shape("Qwen/Qwen2.5-VL-7B-Instruct", image_size=(448, 448))
    v = shape.vision
    s = RunSettings(weight_bytes=2, activation_bytes=2, prompts_per_rank=2, num_generations=8, prompt_length=600,
                    completion_length=256, micro_batch_rows=8, rows_per_step=16, images_per_prompt=2, reference=True,
                    old_logprobs=True)

    def phases(**changes):
        plan = plan_memory(shape, dataclasses.replace(s, **changes), plain_layout(1))
        return {(t.name, t.phases): t.nbytes for t in plan.terms}

    patches = 2 * 1024  # one prompt's two images in an 8-row micro-batch
    tower = phases(train_vision_parts=("vision_tower",))
    # per patch: 13 hidden widths + 4 MLP widths in each of 32 layers, 5 hidden widths before them
    assert tower[("vision activations", ("training",))] == patches * (32 * (13 * 1280 + 4 * 3420) + 5 * 1280) * 2
    assert tower[("projector activations", ("training",))] == 2 * 4 * 1024 * 1280 * 2
    assert ("vision forward", ("training",)) not in tower
    checkpointed = phases(train_vision_parts=("vision_tower",), gradient_checkpointing=True)
    rows_patches = 8 * patches  # every row its own images under checkpointing
    assert checkpointed[("vision activations", ("training",))] == (32 * 1280 + 13 * 1280 + 4 * 3420 + 5 * 1280) * rows_patches * 2
    only_projector = phases(train_vision_parts=("projector",))
    assert ("vision activations", ("training",)) not in only_projector
    assert only_projector[("projector activations", ("training",))] == 2 * v.projector_saved * 2
    assert only_projector[("vision forward", ("training",))] == phases()[("vision forward", ("training",))]
    kept = {"vision activations", "projector activations"}
    assert not kept & {name for name, _ in phases()}  # frozen parts: nothing kept for them
    assert {phase for name, phase in tower if name in kept} == {("training",)}


def test_unknown_parts_are_refused_naming_the_choices():
    args = GRPOConfig(report_to=[], train_vision_parts=["eyes"])
    with pytest.raises(ConfigError, match=r"train_vision_parts \['eyes'\] unknown: choose from \['projector'"):
        run_settings(args, "cpu", 1, algorithm="grpo", use_peft=True, lora_r=4, lora_targets=None, weight_bytes=4)


def test_plan_command_reads_train_vision_parts(capsys):
    from pathlib import Path

    from grpo_ascend.cli import main

    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "default.yaml")
    assert main(["plan", recipe, "--model", "builtin:vlm-llava", "--device", "cpu", "--prompt-length", "20",
                 "--train_vision_parts", "[projector]"]) == 0
    out = capsys.readouterr().out
    # the recipe's r=32 on the projector's 32 -> 64 and 64 -> 64 linears: 32 x (96 + 128)
    assert "vision: trains projector (LoRA on their linear layers: 7,168 trainable elements" in out
    assert "projector activations" in out and "vision activations" not in out


def _saved_bytes(model: torch.nn.Module, forward) -> int:
    """Bytes of every activation storage autograd keeps for the backward of ``forward()`` (each storage once;
    the weights it keeps a reference to are not activations)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 1, "vocab_size": 128}
QWEN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
TOWERS = {  # hidden 96, MLP 384, 3 layers on 112x112 pictures of 7-pixel patches: 256 patches
    "llava": ({"model_type": "clip_vision_model", "hidden_size": 96, "intermediate_size": 384, "num_hidden_layers": 3,
               "num_attention_heads": 4, "image_size": 112, "patch_size": 7}, {"model_type": "llama", **TEXT}, {}),
    "gemma3": ({"model_type": "siglip_vision_model", "hidden_size": 96, "intermediate_size": 384, "num_hidden_layers": 3,
                "num_attention_heads": 4, "image_size": 112, "patch_size": 7, "vision_use_head": False},
               {**TEXT, "head_dim": 16, "layer_types": ["full_attention"]}, {"mm_tokens_per_image": 64}),
    "qwen2_vl": ({"depth": 3, "embed_dim": 96, "mlp_ratio": 4, "hidden_size": 64, "num_heads": 4, "patch_size": 7},
                 {**TEXT, **QWEN_ROPE}, {}),
    "qwen2_5_vl": ({"depth": 3, "hidden_size": 96, "intermediate_size": 384, "out_hidden_size": 64, "num_heads": 4,
                    "patch_size": 7, "fullatt_block_indexes": [1]}, {**TEXT, **QWEN_ROPE}, {}),
    "qwen3_vl": ({"depth": 3, "hidden_size": 96, "intermediate_size": 384, "out_hidden_size": 64, "num_heads": 4,
                  "patch_size": 7, "num_position_embeddings": 256, "deepstack_visual_indexes": []},
                 {**TEXT, **QWEN_ROPE}, {}),
}


@pytest.mark.parametrize("family", sorted(TOWERS))
def test_trained_tower_and_projector_activations_are_what_autograd_keeps(family, tmp_path):
    """One 112x112 picture (float32) through a trained tower and projector, then through a frozen tower and a
    trained projector: the bytes autograd keeps are the plan's vision and projector activations within 5 %."""
    import json

    from transformers import AutoConfig, AutoModelForImageTextToText

    vision, text, extra = TOWERS[family]
    config = AutoConfig.for_model(family, vision_config=vision, text_config=text, **extra)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).float()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 56 * 56, "max_pixels": 112 * 112}))
    shape = vision_language_shape(config.to_dict(), family, tmp_path, image_size=(112, 112))
    if family.startswith("qwen"):
        pixels, grid = torch.randn(256, 3 * 2 * 7 * 7), torch.tensor([[1, 16, 16]])
        def forward():
            return model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid)
    else:
        pixels = torch.randn(1, 3, 112, 112)
        def forward():
            return model.model.get_image_features(pixel_values=pixels)
    s = RunSettings(activation_bytes=4, num_generations=1, micro_batch_rows=1, rows_per_step=1, images_per_prompt=1,
                    prompt_length=8, completion_length=8, use_peft=False, train_vision_parts=None)
    for parts in (None, ("projector",)):
        for name, param in model.named_parameters():  # as build_policy leaves them
            param.requires_grad_(parts is None or any(p in f".{name}." for p in VISION_PARTS["projector"]))
        kept = _saved_bytes(model, forward)
        planned = {t.name: t.nbytes for t in plan_memory(shape, dataclasses.replace(s, train_vision_parts=parts),
                                                         plain_layout(1)).terms}
        total = planned.get("vision activations", 0) + planned["projector activations"]
        assert 0.95 * kept <= total <= 1.05 * kept, (family, parts, kept, total)
