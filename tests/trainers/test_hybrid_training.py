"""GRPO on hybrid decoders (Qwen3-Next, Qwen3.5 dense / MoE, NemotronH), sampled by the built-in engine: steps with
LoRA and with full fine-tuning change the weights with a finite loss, and a reward over token ids rises against
its control (the same trainer evaluated before training)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import SMALL_RUN, index_in_group, rewards_before_and_after_training
from hybrid_models import FAMILIES, hybrid_model
from transformers import AutoTokenizer

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.models.policy import default_lora_config


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _config(tmp_path, **kw):
    return GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "router_aux_loss_coef": 0.0,
                         "max_completion_length": 8, "length_bucket": 1, **kw})


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grpo_steps_change_the_weights_with_a_finite_loss(tmp_path, tok, family, lora):
    """Rewards differ within every group by construction, so every step has a gradient."""
    model = hybrid_model(family, tok)
    cfg = _config(tmp_path, num_generations=4, per_device_train_batch_size=8, max_steps=2, beta=0.04)
    trainer = GRPOTrainer(model, index_in_group(4), cfg, arithmetic_dataset(8), processing_class=tok,
                          peft_config=default_lora_config(r=4) if lora else None)
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if v.requires_grad}
    assert before and all(("lora_" in k) == lora for k in before), family
    if lora:  # all-linear reaches the recurrent mixers (on NemotronH without the out_proj PEFT refuses)
        assert any(".linear_attn." in k or ".mixer.in_proj." in k for k in before), family
        assert not any(".mixer.out_proj." in k for k in before) or family != "nemotron_h", family
    trainer.train()
    changed = [k for k, v in trainer.policy.named_parameters() if v.requires_grad and not torch.equal(v, before[k])]
    assert changed, family
    if not lora:  # recurrent layers' own weights train too (not only the attention layers and the head)
        assert any("A_log" in k or "conv1d" in k for k in changed), (family, changed)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (family, records)


def test_reward_rises_against_its_control(tmp_path, tok):
    """Six GRPO steps with LoRA on Qwen3.5 make the token the untrained policy favours most (1.5% of its next-token
    mass, the runner-up 0.9%) more frequent on held-out prompts than the untrained policy makes it (about 0.4%)."""
    model = hybrid_model("qwen3_5", tok)
    prompts = tok(["What is 3 + 4?", "Hello", "a b c"], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        favoured = int(model(**prompts).logits[:, -1].softmax(-1).mean(0).argmax())

    def favoured_share(prompts, completions, completion_ids, **kwargs):
        return [sum(1 for t in ids if t == favoured) / max(len(ids), 1) for ids in completion_ids]

    cfg = _config(tmp_path, num_generations=8, per_device_train_batch_size=32, max_steps=6, learning_rate=2e-2,
                  temperature=1.0, per_device_eval_batch_size=64)
    trainer = GRPOTrainer(model, favoured_share, cfg, arithmetic_dataset(320, seed=5), processing_class=tok,
                          peft_config=default_lora_config(r=8))
    control, trained = rewards_before_and_after_training(trainer, arithmetic_dataset(32, seed=6))
    assert trained > control + 0.05, (trained, control)
