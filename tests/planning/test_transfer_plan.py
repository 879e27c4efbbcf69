"""The memory plan counts a collective weight sync's buckets on both ends, as the sender allocates them."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_ascend.config.configs import GRPOConfig
from grpo_ascend.distributed.memory_layout import plain_layout
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.sampler_copy import synced_tensors
from grpo_ascend.planning.memory_plan import RunSettings, plan_memory, run_settings, shape_of_config
from grpo_ascend.weight_transfer.manifest import Manifest
from grpo_ascend.weight_transfer.sender import WeightSender

BUCKET = 96 * 1024


def _model() -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def _terms(s: RunSettings, model: torch.nn.Module) -> dict[str, object]:
    shape = shape_of_config(model.config.to_dict())
    return {t.name: t for t in plan_memory(shape, s, plain_layout(1)).terms}


def test_rollout_process_buckets_are_the_senders_staging_bytes():
    model = _model()
    manifest = Manifest.plan([(n, t.dtype, t.shape) for n, t in synced_tensors(model)], BUCKET)
    staged = WeightSender("cpu").staging_bytes(manifest)
    assert len(manifest.buckets) > 2 and staged > 0
    s = RunSettings(use_peft=False, weight_bytes=4, rollout_process="own", transfer_to="rollout process",
                    transfer_bucket_bytes=BUCKET)
    terms = _terms(s, model)
    sender, receiver = terms["weight transfer: sender buckets"], terms["weight transfer: receiver buckets"]
    largest = max(t.nbytes for t in manifest.tensors)
    assert staged <= sender.nbytes <= staged + 2 * largest  # a bucket fills up to its last tensor
    assert receiver.nbytes == sender.nbytes
    assert "training" in sender.phases and receiver.phases == ("rollout device",)
    assert terms["rollout process: previous version"].nbytes == sum(t.numel() * 4 for t in model.parameters())
    assert "weight ring" not in terms
    report = plan_memory(shape_of_config(model.config.to_dict()), s, plain_layout(1)).report()
    assert "weight transfer: sender buckets" in report and "weight transfer: receiver buckets" in report


def _settings(**config: object) -> RunSettings:
    args = GRPOConfig(rollout_mode="one_step_off", max_prompt_length=32, max_completion_length=16, num_generations=2,
                      per_device_train_batch_size=2, **config)
    return run_settings(args, "cpu", 1, algorithm="grpo", use_peft=False, lora_r=8, lora_targets=None, weight_bytes=4)


def test_run_settings_plan_the_transfer_the_run_resolves():
    s = _settings(weight_transfer="collective", weight_transfer_bucket_bytes=BUCKET)
    assert (s.transfer_to, s.transfer_bucket_bytes, s.ring_in_device_memory) == ("rollout process", BUCKET, False)
    auto = _settings(weight_transfer="auto")
    assert auto.transfer_to is None and auto.ring_in_device_memory  # one host: the shared-memory ring
    with pytest.raises(ConfigError, match="weight_transfer='files' does not apply to the built-in rollout process"):
        _settings(weight_transfer="files")
