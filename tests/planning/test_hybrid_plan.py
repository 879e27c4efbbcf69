"""The memory plan of hybrid decoders: keys/values for the attention layers only, and each row's recurrent state
(convolution window + float32 state) per recurrent layer, equal to what the rollout engine allocates."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import hybrid_model
from transformers import AutoTokenizer

from grpo_ascend.distributed.memory_layout import plain_layout
from grpo_ascend.planning.memory_plan import RunSettings, load_model_shape, plan_memory
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.sampling import SamplingParams


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "nemotron_h"])
def test_plan_counts_the_state_and_keys_the_engine_allocates(tmp_path, tok, family, dtype):
    model = hybrid_model(family, tok).to(dtype)
    model.config.save_pretrained(tmp_path)
    shape = load_model_shape("x", tmp_path / "config.json")
    a = torch.finfo(dtype).bits // 8
    prompts, group, width = 3, 4, 8
    batch = RolloutEngine(model, tok).prefill([tok("hello there").input_ids, tok("a").input_ids, tok("b c").input_ids],
                                              SamplingParams(num_generations=group, max_completion_length=width))
    rows, columns = prompts * group, batch.prompt_width + batch.completion_width
    state = sum(layer.nbytes() for layer in batch.cache.recurrent_layers)
    keys = batch.cache.nbytes() - state
    assert state > 0 and state == shape.state_bytes_per_row(a) * rows, (family, state)
    assert keys == shape.kv_bytes_per_token(a) * rows * columns, (family, keys)
    assert shape.attention_layers == len(batch.cache.attention_layers) < shape.num_layers

    s = RunSettings(weight_bytes=a, activation_bytes=a, prompts_per_rank=prompts, num_generations=group,
                    prompt_length=batch.prompt_width, completion_length=width, shared_prefix_decode=True)
    terms = {t.name: t.nbytes for t in plan_memory(shape, s, plain_layout(1)).terms}
    assert terms["rollout recurrent state"] == shape.state_bytes_per_row(a) * (rows + prompts)  # + the prefill's
    # no shared prefix for a hybrid: every row holds its prompt's keys, as allocated (+ the prefill cache)
    assert terms["rollout KV cache"] == keys + shape.kv_bytes_per_token(a) * prompts * batch.prompt_width
