"""Compiled decode step: the same greedy tokens and log-probs as eager; option validation and default."""

from __future__ import annotations

import pytest
import torch

from grpo_ascend import device as dev
from grpo_ascend.device import default_compile_decode
from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.sampling import SamplingParams

PROMPTS = ["Hello world", "The cat sat on a long road", "What is 3 + 4?"]


def _recorded_compilations(monkeypatch) -> list:
    """The models the device layer compiles for decoding from now on (compiled as usual)."""
    models, compile_for_decode = [], dev.compile_for_decode

    def recording(model, device):
        models.append(model)
        return compile_for_decode(model, device)

    monkeypatch.setattr(dev, "compile_for_decode", recording)
    return models


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_greedy_tokens(tiny_model_dir, monkeypatch):
    """Rows finish at different steps (stop ids), so compaction runs the compiled step at several batch sizes.

    The tiny model cut to its first 2 decoder layers: still a stack of layers with a KV cache each, and
    half the graph for dynamo and inductor to trace and lower (most of the test's time on the CPU).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, num_hidden_layers=2,
                                                 layer_types=["full_attention"] * 2).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(model.model.layers) == 2
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)  # greedy outputs that vary
    params = dict(num_generations=2, max_completion_length=10, temperature=0, ignore_eos=True)
    free = RolloutEngine(model, tok).generate(PROMPTS, SamplingParams(**params)).completion_ids
    params["stop_token_ids"] = [int(free[0, 2]), int(free[2, 5])]  # prompts 0 and 1 end early
    compiled_models = _recorded_compilations(monkeypatch)
    eager = RolloutEngine(model, tok).generate(PROMPTS, SamplingParams(compile_decode=False, **params))
    assert compiled_models == []
    compiled = RolloutEngine(model, tok).generate(PROMPTS, SamplingParams(compile_decode=True, **params))
    assert compiled_models == [model]  # compiled once, for all the decode steps
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    assert torch.equal(compiled.completion_mask, eager.completion_mask)
    torch.testing.assert_close(compiled.sampling_logprobs, eager.sampling_logprobs, atol=2e-5, rtol=1e-5)
    assert len(eager.decode_batch_sizes) > 1, "the prompts should exercise compaction"


def test_compile_decode_option_is_checked_and_off_by_default_on_cpu(tiny_model, monkeypatch):
    with pytest.raises(ConfigError, match="compile_decode"):
        SamplingParams(compile_decode="yes")
    assert default_compile_decode(torch.device("cpu")) is False
    model, tok = tiny_model
    compiled_models = _recorded_compilations(monkeypatch)
    RolloutEngine(model, tok).generate(PROMPTS[:1], SamplingParams(num_generations=1, max_completion_length=2,
                                                                  temperature=0))
    assert compiled_models == []  # nothing compiled unless asked
