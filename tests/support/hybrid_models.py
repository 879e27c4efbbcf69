"""Tiny random-weight hybrid decoders for the tests: Qwen3-Next, Qwen3.5 (dense and MoE) and NemotronH.

Each family is a few layers of each type (linear attention or Mamba2, full attention, MoE / MLP blocks) at
hidden size 32 over the tiny tokenizer's vocabulary, built in milliseconds from a config (nothing is
downloaded). Weights are perturbed (seeded) so that greedy decoding varies instead of repeating one token.

The perturbation is kept at 0.15: the torch reference of the chunked gated-DeltaNet scan (what runs without
flash-linear-attention) rounds more as the weights grow, and at 0.3 its log-probs differ from its own
step-by-step form by up to 1e-4 (float64 models too: the kernel computes in float32), at 0.15 by about 1e-5.
"""

from __future__ import annotations

import torch
from helpers import perturb_weights

#: The layer pattern every family shares: recurrent, attention, recurrent, attention.
PATTERN = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

_LINEAR_ATTENTION = dict(
    linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def _common(tokenizer) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=32, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True)


def _qwen3_next(tokenizer):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(Qwen3NextConfig(**_common(tokenizer), **_LINEAR_ATTENTION, **_MOE,
                                                num_hidden_layers=4, layer_types=PATTERN, decoder_sparse_step=1))


def _qwen3_5(tokenizer):
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_common(tokenizer), **_LINEAR_ATTENTION, num_hidden_layers=4,
                                                layer_types=PATTERN))


def _qwen3_5_moe(tokenizer):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_common(tokenizer), **_LINEAR_ATTENTION, **_MOE,
                                                      num_hidden_layers=4, layer_types=PATTERN))


def _nemotron_h(tokenizer):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        **_common(tokenizer), layers_block_type=["linear_attention", "full_attention", "moe", "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=8,
        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, n_group=1,
        topk_group=1,
    )
    return NemotronHForCausalLM(config)


#: Family name (its transformers model type) -> builder from a tokenizer.
FAMILIES = {"qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe, "nemotron_h": _nemotron_h}


def hybrid_model(family: str, tokenizer, seed: int = 0, scale: float = 0.15):
    """A fresh float32 ``family`` model over ``tokenizer``'s vocabulary in eval mode, weights seeded and perturbed."""
    torch.manual_seed(seed)
    model = FAMILIES[family](tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return perturb_weights(model, scale=scale, seed=seed).eval()
