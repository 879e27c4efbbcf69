"""TRL 1.16 adds a Mixture-of-Experts policy's load-balancing loss to the GRPO loss (issue 37): on where the model
config declares ``output_router_logits`` and the coefficient (``router_aux_loss_coef``, else the config's) is not
0; the model's own loss over prompt and completion tokens; ``coef · aux / gradient_accumulation_steps`` per
micro-batch; logged as ``aux_loss``; ``trainer.aux_loss_enabled`` says whether it is on."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL_RUN
from transformers import AutoTokenizer

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.data.synthetic import arithmetic_dataset
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import CompletionLogprobs
from grpo_ascend.models.router_aux import router_aux_for


def _tiny_moe(vocab_size: int = 64):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                            shared_expert_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)
    return Qwen2MoeForCausalLM(config)


def test_trls_rule_decides_whether_the_loss_is_on():
    moe = _tiny_moe()
    assert moe.config.router_aux_loss_coef == 0.001
    assert router_aux_for(moe, None).coef == 0.001  # the model config's coefficient
    assert router_aux_for(moe, 0.5).coef == 0.5
    assert router_aux_for(moe, 0.0) is None  # TRL's way to turn it off
    dense = torch.nn.Linear(2, 2)
    dense.config = type("Config", (), {})()
    assert router_aux_for(dense, None) is None
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.5 but Linear is not a Mixture-of-Experts"):
        router_aux_for(dense, 0.5)


def test_the_forward_returns_the_models_own_load_balancing_loss():
    moe = _tiny_moe()
    forward = CompletionLogprobs(moe, router_aux=router_aux_for(moe, None))
    prompt_ids, prompt_mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids, completion_mask = torch.tensor([[10, 11, 0], [12, 13, 14]]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    logps, _, aux = forward(prompt_ids, prompt_mask, completion_ids, completion_mask, aux_loss=True)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    expected = moe(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                   position_ids=(mask.cumsum(-1) - 1).clamp(min=0), output_router_logits=True).aux_loss
    torch.testing.assert_close(aux, expected)
    plain, _ = forward(prompt_ids, prompt_mask, completion_ids, completion_mask)
    torch.testing.assert_close(logps * completion_mask, plain * completion_mask)
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts model's router_aux"):
        CompletionLogprobs(moe)(prompt_ids, prompt_mask, completion_ids, completion_mask, aux_loss=True)


def _trained(tmp_path, tiny_model_dir, coef):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    args = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path / f"run{coef}"), "num_generations": 2,
                         "per_device_train_batch_size": 4, "max_steps": 1, "learning_rate": 0.0,
                         "router_aux_loss_coef": coef})
    trainer = GRPOTrainer(_tiny_moe(len(tokenizer)), lambda completions, **kw: [float(len(c)) for c in completions],
                          args, arithmetic_dataset(8), processing_class=tokenizer)
    trainer.train()
    return trainer


def test_training_adds_coef_times_the_loss_and_logs_it(tmp_path, tiny_model_dir):
    on, off = _trained(tmp_path, tiny_model_dir, 1.0), _trained(tmp_path, tiny_model_dir, 0.0)
    assert on.aux_loss_enabled and not off.aux_loss_enabled
    logged_on, logged_off = on.state.log_history[0], off.state.log_history[0]
    assert logged_on["aux_loss"] > 0 and "aux_loss" not in logged_off
    # the same seed samples the same completions: the losses differ by coef · aux (one micro-batch per step)
    assert logged_on["loss"] - logged_off["loss"] == pytest.approx(logged_on["aux_loss"], rel=1e-4)
