"""The offline tiny vision-language models build deterministically, load with transformers' Auto classes, render
image parts in their family's chat format, expand images to the right number of tokens, and read the image."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from grpo_ascend.errors import ConfigError
from grpo_ascend.models import tiny_vlm
from grpo_ascend.models.tiny_model import builtin_architecture, resolve_builtin
from grpo_ascend.models.tiny_vlm import FAMILIES, build_tiny_vlm
from grpo_ascend.models.tiny_vlm_processors import load_vlm_processor

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

#: family -> (model class, image tokens of a 56x56 picture, of a 28x28 one)
EXPECTED = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", 16, 4),
    "llava": ("LlavaForConditionalGeneration", 16, 16),  # resized and cropped to 28x28 whatever the input
    "llava_next": ("LlavaNextForConditionalGeneration", 36, 36),  # a base view and one tile (with row ends)
    "gemma4": ("Gemma4ForConditionalGeneration", 64, 64),  # resized onto up to 70 soft tokens, aspect kept
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", 16, 4),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", 16, 4),
}
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 2 + 3?"}]}]
RENDERED = {
    "qwen2_5_vl": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is 2 + 3?<|im_end|>\n"
                  "<|im_start|>assistant\n",
    "llava": "USER: <image>\nWhat is 2 + 3? ASSISTANT:",
    "gemma4": "<|turn>user\n<|image|>What is 2 + 3?<|im_end|>\n<|turn>model\n",
}
#: The family whose chat template each family shares.
TEMPLATE_OF = {"qwen2_5_vl": "qwen2_5_vl", "qwen3_5": "qwen2_5_vl", "qwen3_5_moe": "qwen2_5_vl", "llava": "llava",
               "llava_next": "llava", "gemma4": "gemma4"}
RENDERED.update({family: RENDERED[same] for family, same in TEMPLATE_OF.items()})
#: The processor class each family's folder names.
PROCESSOR_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "llava": "LlavaProcessor", "qwen3_5": "Qwen3VLProcessor",
                     "qwen3_5_moe": "Qwen3VLProcessor", "llava_next": "LlavaNextProcessor",
                     "gemma4": "Gemma4Processor"}


def picture(seed: int, side: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(request, tmp_path_factory):
    """(family, folder, model, processor): one build per family for the whole module."""
    from transformers import AutoModelForImageTextToText

    folder = build_tiny_vlm(request.param, out_dir=tmp_path_factory.mktemp(request.param) / "model")
    return request.param, folder, AutoModelForImageTextToText.from_pretrained(folder).eval(), load_vlm_processor(folder)


def inputs(processor, images, messages=QUESTION):
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # one picture per row, nested (Gemma's processors read a flat list as one row's pictures)
    return processor(text=[text] * len(images), images=[[i] for i in images], return_tensors="pt", padding=True)


def test_loads_with_auto_classes_and_renders_image_parts(built):
    family, _, model, processor = built
    assert type(model).__name__ == EXPECTED[family][0]
    assert not model.training
    assert processor.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False) == RENDERED[family]
    assert model.config.get_text_config().hidden_size <= 128
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_multi_turn_and_string_content_render(built):
    family, _, _, processor = built
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION,
                {"role": "assistant", "content": [{"type": "text", "text": "5"}]},
                {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "image"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = {
        "qwen2_5_vl": "<|im_start|>system\nBe brief.<|im_end|>\n" + RENDERED["qwen2_5_vl"] + "5<|im_end|>\n"
                      "<|im_start|>user\nAnd<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|>"
                      "<|vision_end|><|im_end|>\n<|im_start|>assistant\n",
        "llava": "Be brief. USER: <image>\nWhat is 2 + 3? ASSISTANT: 5<|im_end|> USER: <image>\n<image>\nAnd ASSISTANT:",
        "gemma4": "<|turn>system\nBe brief.<|im_end|>\n" + RENDERED["gemma4"] + "5<|im_end|>\n<|turn>user\nAnd<|image|>"
                  "<|image|><|im_end|>\n<|turn>model\n",
    }
    assert text == expected[TEMPLATE_OF[family]]


@pytest.mark.parametrize("side,which", [(56, 1), (28, 2)])
def test_processor_expands_each_image_to_its_token_count(built, side, which):
    family, _, model, processor = built
    batch = inputs(processor, [picture(0, side)])
    assert (batch["input_ids"] == model.config.image_token_id).sum().item() == EXPECTED[family][which]


def test_two_images_in_one_prompt_expand_in_place(built):
    family, _, model, processor = built
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "or"}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = processor(text=[text], images=[picture(0, 56), picture(1, 28)], return_tensors="pt")
    expected = EXPECTED[family][1] + EXPECTED[family][2]
    assert (batch["input_ids"] == model.config.image_token_id).sum().item() == expected


def test_forward_with_pixels_has_finite_logits_and_reads_the_image(built):
    family, _, model, processor = built
    batch = inputs(processor, [picture(0), picture(1)])  # one batch: two rows, two different images
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], model.config.get_text_config().vocab_size)
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[0, -1], logits[1, -1], atol=1e-4)
    with torch.no_grad():
        first = model(**inputs(processor, [picture(0)])).logits
    torch.testing.assert_close(first[0, -1], logits[0, -1], atol=1e-5, rtol=1e-5)


def test_greedy_generate_with_an_image_is_deterministic(built):
    _, _, model, processor = built
    batch = inputs(processor, [picture(2)])
    runs = [model.generate(**batch, max_new_tokens=6, do_sample=False) for _ in range(2)]
    assert runs[0].shape == (1, batch["input_ids"].shape[1] + 6)
    assert torch.equal(runs[0], runs[1])


def test_build_is_deterministic(built, tmp_path):
    family, folder, _, _ = built
    again = build_tiny_vlm(family, out_dir=tmp_path / "again")
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (folder / name).read_bytes() == (again / name).read_bytes(), name


def test_qwen_vision_tower_uses_window_attention():
    """A 56x56 picture is 8x8 patches: four 28-pixel windows of 4x4 patches in the window-attention block."""
    from transformers.vision_utils import get_vision_window_index

    grid = torch.tensor([[1, 8, 8]])
    _, cu_window_seqlens = get_vision_window_index(grid, spatial_merge_size=2, window_size=4 * tiny_vlm.PATCH,
                                                   patch_size=tiny_vlm.PATCH)
    assert torch.unique_consecutive(torch.as_tensor(cu_window_seqlens)).tolist() == [0, 16, 32, 48, 64]


def test_processor_loads_without_torchvision(built, monkeypatch):
    family, folder, _, _ = built
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)
    processor = load_vlm_processor(folder)
    assert type(processor.image_processor).__name__.endswith("Pil")
    assert not hasattr(processor, "video_processor")
    assert type(pickle.loads(pickle.dumps(processor))) is type(processor)  # a rollout process can receive it
    assert (inputs(processor, [picture(0)])["input_ids"] == processor.image_token_id).sum() == EXPECTED[family][1]
    saved = json.loads((folder / "processor_config.json").read_text())
    assert saved["processor_class"] == PROCESSOR_CLASSES[family]


def test_auto_processor_loads_the_folder_where_torchvision_works(built):
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    family, folder, _, _ = built
    processor = AutoProcessor.from_pretrained(folder)
    assert (inputs(processor, [picture(0)])["input_ids"] == processor.image_token_id).sum() == EXPECTED[family][1]


def test_builtin_names_resolve_through_the_family_registry(monkeypatch, tmp_path):
    monkeypatch.setattr(tiny_vlm, "build_tiny_vlm", lambda family, warm: tmp_path / f"{family}{'-warm' * warm}")
    assert resolve_builtin("builtin:vlm-llava") == tmp_path / "llava"
    assert resolve_builtin("builtin:vlm-qwen2_5_vl-warm") == tmp_path / "qwen2_5_vl-warm"
    with pytest.raises(ConfigError, match=r"builtin:vlm-lava.*'gemma4', 'llava', 'llava_next', 'qwen2_5_vl'.*did you mean 'llava'"):
        resolve_builtin("builtin:vlm-lava")
    with pytest.raises(ConfigError, match=r"builtin:vlm-llava-hot.*builtin:vlm-<family>\[-warm\]"):
        resolve_builtin("builtin:vlm-llava-hot")
    with pytest.raises(ConfigError, match="cannot be planned"):
        builtin_architecture("builtin:vlm-llava")


def test_unknown_family_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"'qwen25_vl'.*\['gemma4', 'llava', 'llava_next', 'qwen2_5_vl'.*did you mean 'qwen2_5_vl'"):
        build_tiny_vlm("qwen25_vl")


def test_cli_builds_the_family_asked_for(monkeypatch, tmp_path, capsys):
    from grpo_ascend import cli

    calls = []
    monkeypatch.setattr(tiny_vlm, "build_tiny_vlm", lambda family, **kw: calls.append((family, kw)) or tmp_path)
    assert cli.main(["build-tiny-vlm", "--family", "llava", "--seed", "3"]) == 0
    assert cli.main(["build-tiny-vlm", "--warm"]) == 0
    assert calls == [("llava", {"seed": 3, "out_dir": None, "force": False, "warm": False, "head_dim": 16}),
                     ("qwen2_5_vl", {"seed": 0, "out_dir": None, "force": False, "warm": True, "head_dim": 16})]
    assert capsys.readouterr().out.split() == [str(tmp_path)] * 2


def test_image_only_fallback_reads_older_saves(built, tmp_path, monkeypatch):
    """Released Qwen2.5-VL folders name their processor in preprocessor_config.json (no processor_config.json)."""
    import shutil

    import transformers.utils

    family, folder, _, _ = built
    if family != "qwen2_5_vl":
        pytest.skip("only Qwen2.5-VL's processor needs torchvision")
    old = shutil.copytree(folder, tmp_path / "old")
    images = json.loads((old / "processor_config.json").read_text())["image_processor"]
    (old / "processor_config.json").unlink()
    (old / "preprocessor_config.json").write_text(json.dumps({**images, "processor_class": "Qwen2_5_VLProcessor"}))
    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)
    processor = load_vlm_processor(old)
    assert (inputs(processor, [picture(0)])["input_ids"] == processor.image_token_id).sum() == EXPECTED[family][1]


def test_image_only_fallback_loads_a_hub_id_from_the_cache(built, tmp_path, monkeypatch):
    """A hub id (not a folder) is looked up in the hub cache for its processor class, so without torchvision it
    loads image-only too (it went to AutoProcessor, which raised ImportError)."""
    import shutil

    import huggingface_hub.constants
    import transformers.utils

    family, folder, _, _ = built
    if family != "qwen2_5_vl":
        pytest.skip("only Qwen2.5-VL's processor needs torchvision")
    repo = tmp_path / "hub" / "models--someone--tiny-vl"
    shutil.copytree(folder, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(transformers.utils, "is_torchvision_available", lambda: False)
    processor = load_vlm_processor("someone/tiny-vl")
    assert type(processor).__name__ == "ImageOnlyQwen2_5_VLProcessor"
    assert (inputs(processor, [picture(0)])["input_ids"] == processor.image_token_id).sum() == EXPECTED[family][1]
