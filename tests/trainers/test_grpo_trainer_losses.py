"""CISPO, SAPO and the KL options through the GRPO trainer: the config reaches the loss, and
gradient accumulation stays exact (one micro-batch of 8 vs 4 of 2)."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_RUN, first_digit_is_one, fixed_experience, one_round_gradients

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.models.policy import default_lora_config

CASES = [
    {"loss_type": "cispo", "epsilon_high": 5.0, "kl_estimator": "k1", "use_bias_correction_kl": True},
    {"loss_type": "sapo", "sapo_temperature_neg": 2.0, "kl_estimator": "k2", "use_bias_correction_kl": False},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["loss_type"])
def test_new_losses_accumulate_exactly(tmp_path, tiny_model_dir, case):
    grads = []
    for micro, accum in ((8, 1), (2, 4)):
        cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / "run"), "per_device_train_batch_size": micro,
                            "gradient_accumulation_steps": accum, "steps_per_generation": accum, "beta": 0.04,
                            "num_generations": 2, **case})
        trainer = GRPOTrainer(str(tiny_model_dir), first_digit_is_one, cfg, arithmetic_dataset(8),
                              peft_config=default_lora_config(r=4))
        settings = trainer.loss_settings
        assert (settings.kl_estimator, settings.use_bias_correction_kl) == (case["kl_estimator"],
                                                                             case["use_bias_correction_kl"])
        assert settings.sapo_temperature_neg == case.get("sapo_temperature_neg", 1.05)
        for name, p in trainer.policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(hash(name) % 1000))
        grads.append(one_round_gradients(trainer, fixed_experience())[0])
    assert any(g.abs().max() > 0 for g in grads[0].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5)
