"""The rollout seam (grpo_ascend/rollout/backend.py): the registry, ids in and out, sessions, weight sync.

The built-in engine's numbers are checked against ``model.generate`` in test_rollout.py and its
multi-turn continuation in test_multiturn.py; here: the seam's own promises, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import SMALL_RUN

from grpo_ascend import GRPOConfig, GRPOTrainer
from grpo_ascend.errors import ConfigError
from grpo_ascend.models.policy import default_lora_config
from grpo_ascend.rollout.backend import build_backend, register_backend
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.trainers.components import build_rollout_backend

PROMPTS = ["The river", "Once upon a time in a land far away", "x"]


def _same_completions(a, b) -> None:
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_logprobs", "truncated"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.completion_texts == b.completion_texts and a.prompt_texts == b.prompt_texts


def test_registry_builds_backends_by_name_and_names_the_known_ones(chaotic):
    model, tok = chaotic
    params = SamplingParams(num_generations=2)
    built = build_backend("builtin", model, tok, params, None)
    assert isinstance(built, RolloutEngine) and built.params is params and built.backend is built
    with pytest.raises(ConfigError, match=r"rollout_backend='vlm' is not a known rollout backend; choose one of \[.*'builtin'"):
        build_backend("vlm", model, tok, params, None)
    made = []

    def factory(policy, tokenizer, sampling, args):
        made.append((policy, sampling.num_generations, args.rollout_backend))
        return RolloutEngine(policy, tokenizer, sampling)

    register_backend("mine", factory)  # names only these tests use: left registered
    engine = build_rollout_backend(model, tok, GRPOConfig(rollout_backend="mine", num_generations=4,
                                                 per_device_train_batch_size=4), torch.device("cpu"))
    assert isinstance(engine, RolloutEngine) and made == [(model, 4, "mine")]
    register_backend("wrong", lambda *a: object())
    with pytest.raises(ConfigError, match="built object, not a RolloutBackend"):
        build_backend("wrong", model, tok, params, None)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_is_generate_ids_of_the_encoded_prompts(chaotic, temperature):
    """Text in = ids in: the prompts are rendered and tokenized once, by the seam, for every backend."""
    model, tok = chaotic
    engine = RolloutEngine(model, tok)
    params = SamplingParams(num_generations=3, max_completion_length=12, temperature=temperature,
                            stop_token_ids=[7, 11, 30])
    text = engine.generate(PROMPTS, params, torch.Generator().manual_seed(5))
    encoded = engine.prompts.encode(PROMPTS, params)
    ids = engine.generate_ids(encoded.ids, params, torch.Generator().manual_seed(5), prompt_texts=encoded.texts)
    _same_completions(text, ids)
    decoded = engine.generate_ids(encoded.ids, params, torch.Generator().manual_seed(5))
    assert decoded.prompt_texts == text.prompt_texts  # plain-text prompts decode back to themselves
    assert torch.equal(decoded.completion_ids, text.completion_ids)


def test_session_without_appends_is_the_single_turn_rollout(chaotic):
    """A session nobody appends to samples exactly what generate_ids samples (ids, log-probs, masks,
    compaction), and reports each row once, where it stopped."""
    model, tok = chaotic
    engine = RolloutEngine(model, tok)
    stops = [7, 11, 30, *range(50, 70)]
    # Sessions decode with the plain KV cache (rows are fed several tokens at once): so does the reference here.
    params = SamplingParams(num_generations=3, max_completion_length=16, stop_token_ids=stops, seed=3, shared_prefix=False)
    ids = engine.prompts.encode(PROMPTS, params).ids
    single = engine.generate_ids(ids, params)
    ends = {}
    with engine.start_session(ids, params) as session:
        while turn := session.advance():
            for end in turn:
                assert end.row not in ends
                ends[end.row] = end
        assert session.advance() == []
        out = session.output()
    assert torch.equal(out.completion_ids, single.completion_ids)
    assert torch.equal(out.sampling_logprobs, single.sampling_logprobs)
    assert torch.equal(out.generated.long(), single.completion_mask)
    assert torch.equal(out.prompt_ids, single.prompt_ids) and torch.equal(out.prompt_mask, single.prompt_mask)
    assert out.decode_batch_sizes == single.decode_batch_sizes and len(out.decode_batch_sizes) > 1
    assert sorted(ends) == list(range(9))
    for r, end in ends.items():
        n = int(single.completion_lengths[r])
        assert end.length == n and end.tokens == single.completion_ids[r, :n].tolist()
        assert end.stopped == (end.tokens[-1] in stops) == (not bool(single.truncated[r]))
    assert not model.training


def test_appended_tokens_are_context_out_of_the_log_probs_and_appending_is_checked(chaotic):
    """Every token is a stop id, so each row stops after one token: row 0 gets two tokens appended
    and continues (its next turn is the one token after them), row 1 is left and finished."""
    model, tok = chaotic
    engine = RolloutEngine(model, tok)
    params = SamplingParams(num_generations=2, max_completion_length=8, stop_token_ids=list(range(engine.vocab_size)),
                            seed=0)
    with engine.start_session(engine.prompts.encode(PROMPTS[:1], params).ids, params) as session:
        ends = session.advance()
        assert [(e.row, e.stopped, e.length, len(e.tokens)) for e in ends] == [(0, True, 1, 1), (1, True, 1, 1)]
        with pytest.raises(ConfigError, match="leaves no room under max_completion_length=8"):
            session.append(0, [5] * 7)
        session.append(0, [5, 6])
        with pytest.raises(ConfigError, match="row 0 is not paused"):
            session.append(0, [5])  # once per pause
        (end,) = session.advance()
        assert (end.row, end.stopped, end.length, len(end.tokens)) == (0, True, 4, 1)
        assert session.advance() == []
        with pytest.raises(ConfigError, match="row 1 is not paused"):
            session.append(1, [5])
        out = session.output()
    assert out.lengths.tolist() == [4, 1]
    assert out.completion_ids[0, 1:3].tolist() == [5, 6] and out.completion_ids[0, 3] == end.tokens[0]
    assert out.generated[:, :4].tolist() == [[True, False, False, True], [True, False, False, False]]
    assert (out.sampling_logprobs[0, 1:3] == 0).all() and (out.sampling_logprobs[0, [0, 3]] < 0).all()
    with pytest.raises(ConfigError, match="stop_strings"):
        engine.start_session([[1, 2]], SamplingParams(stop_strings=["a"]))


def test_policy_weights_name_the_adapter_or_every_tensor_without_copies(tiny_model):
    from peft import get_peft_model, get_peft_model_state_dict

    model, _ = tiny_model
    full = PolicyWeights(model, version=3)
    assert not full.adapter_only and full.version == 3
    tensors = dict(full.named_tensors())
    assert list(tensors) == list(model.state_dict())
    assert tensors["lm_head.weight"].data_ptr() == model.lm_head.weight.data_ptr()
    with pytest.raises(ConfigError, match="needs a PEFT policy"):
        full.adapter_config()
    peft = get_peft_model(model, default_lora_config(r=4))
    adapter = PolicyWeights(peft, version=0)
    assert adapter.adapter_only
    names = [n for n, _ in adapter.named_tensors()]
    assert names == list(get_peft_model_state_dict(peft)) and names and all("lora_" in n for n in names)
    assert adapter.adapter_config()["r"] == 4


def test_the_trainer_serves_its_backend_around_every_generation(tmp_path, tiny_model_dir):
    """Each round: restore, then sync the policy's weights of that step (LoRA: adapter only), then
    release after sampling; the trainer never asks which backend it holds."""
    calls = []

    class Recording(RolloutEngine):
        def restore_memory(self):
            calls.append("restore")

        def sync_weights(self, weights):
            calls.append(("sync", weights.version, weights.adapter_only, self.model.training))

        def release_memory(self):
            calls.append("release")

    register_backend("recording", lambda p, t, s, a: Recording(p, t, s))
    cfg = GRPOConfig(**{**SMALL_RUN, "output_dir": str(tmp_path), "rollout_backend": "recording"})
    trainer = GRPOTrainer(str(tiny_model_dir), lambda completions, **kw: [float(len(c)) for c in completions], cfg,
                          Dataset.from_list([{"prompt": p} for p in ("alpha", "beta", "gamma", "delta")]),
                          peft_config=default_lora_config(r=4))
    assert isinstance(trainer.rollout.backend, Recording)
    trainer.train()
    assert calls == ["restore", ("sync", 0, True, False), "release", "restore", ("sync", 1, True, False), "release"]
