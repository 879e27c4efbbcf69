"""The rollout engine on hybrid decoders (Qwen3-Next, Qwen3.5 dense / MoE, NemotronH): greedy parity with
``generate`` on a left-padded batch of groups and with each prompt run alone, sampler log-probs equal to the
trainer's, compaction keeping each row's recurrent state, multi-turn feeds, the cache's row operations, and the
rollout process (asynchronous rollouts) sampling as the engine does.

Greedy comparisons stop before the first step where the reference's two best logits are closer than
``MARGIN``: float rounding differs between CPUs (and between the scan's chunked and step-by-step forms), so
only a clear argmax is a fair test; every comparison checks that most tokens were compared.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_models import FAMILIES, hybrid_model
from transformers import AutoTokenizer

from grpo_ascend.models.policy import CompletionLogprobs
from grpo_ascend.models.recurrent_state import RecurrentStateLayer
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.kv_cache import BucketedKVCache
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.process.client import ProcessBackend, ProcessSettings
from grpo_ascend.rollout.sampling import SamplingParams

PROMPTS = [
    "Hello world",
    "The cat sat on a long road and then the moon rose over the city",
    "What is 3 + 4?",
    "a",
]
NEW = 16
MARGIN = 1e-4


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hybrid(request, tok):
    return request.param, hybrid_model(request.param, tok)


def greedy_reference(model, tok, prompts, max_new):
    """``generate``'s greedy tokens [N, max_new] of a left-padded batch and how many leading steps have a clear argmax."""
    enc = tok(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores, 1).topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1] > MARGIN).all(0)
    return out.sequences[:, enc["input_ids"].shape[1]:], int(clear.long().cumprod(0).sum())


def greedy_params(group: int, **kwargs) -> SamplingParams:
    return SamplingParams(num_generations=group, max_completion_length=NEW, temperature=0.0, ignore_eos=True, **kwargs)


def test_greedy_matches_generate_batched_and_row_by_row(hybrid, tok):
    """A left-padded batch of prompts of different lengths, G=3 rows each, equals ``generate`` on the same batch and
    on each prompt alone (no padding): padding never reaches a row's recurrent state."""
    name, model = hybrid
    batch = RolloutEngine(model, tok).generate(PROMPTS, greedy_params(3))
    ours = batch.completion_ids.view(len(PROMPTS), 3, -1)
    assert (ours == ours[:, :1]).all(), name  # a group's greedy rows are one row
    ref, clear = greedy_reference(model, tok, PROMPTS, NEW)
    assert clear >= NEW // 2, (name, clear)
    assert torch.equal(ours[:, 0, :clear], ref[:, :clear]), name
    for i, prompt in enumerate(PROMPTS):
        alone, alone_clear = greedy_reference(model, tok, [prompt], NEW)
        n = min(clear, alone_clear)
        assert n >= NEW // 2, (name, prompt, alone_clear)
        assert torch.equal(ours[i, 0, :n], alone[0, :n]), (name, prompt)


def test_sampler_logprobs_equal_the_trainers(hybrid, tok):
    """Sampled tokens' log-probs (prefill in chunked form, decode step by step) equal the trainer's log-prob forward
    over prompt + completion (with the group's prompt run once, and without)."""
    name, model = hybrid
    params = SamplingParams(num_generations=3, max_completion_length=NEW, temperature=0.8, seed=5)
    batch = RolloutEngine(model, tok).generate(PROMPTS, params)
    mask = batch.completion_mask.bool()
    assert mask.sum() > len(PROMPTS) * 3 * 4  # something was sampled
    for share in (True, False):
        with torch.no_grad():
            lps, _ = CompletionLogprobs(model, share_prompts=share)(
                batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, temperature=0.8)
        torch.testing.assert_close(batch.sampling_logprobs[mask], lps[mask], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, share=share: f"{name} share_prompts={share}: {m}")


def test_compaction_keeps_each_rows_state(hybrid, tok):
    """Rows that stop at different steps are compacted away; the rows left keep their own states: every row's tokens
    equal the uncompacted run's and, up to its stop, ``generate``'s."""
    name, model = hybrid
    ref, clear = greedy_reference(model, tok, PROMPTS, NEW)
    # The first two prompts' rows stop early (at their own tokens 3 and 7, or wherever a stop token comes first).
    params = greedy_params(2, stop_token_ids=[int(ref[0, 2]), int(ref[1, 6])])
    compacted = RolloutEngine(model, tok).generate(PROMPTS, params)
    whole = RolloutEngine(model, tok, compact=False).generate(PROMPTS, params)
    assert len(compacted.decode_batch_sizes) > 1, (name, compacted.decode_batch_sizes)  # rows were dropped
    assert compacted.completion_lengths.max() > 7, name  # and some decoded on after it
    assert torch.equal(compacted.completion_ids, whole.completion_ids), name
    assert torch.equal(compacted.completion_mask, whole.completion_mask), name
    for row in range(len(PROMPTS) * 2):
        n = min(int(compacted.completion_lengths[row]), clear)
        assert torch.equal(compacted.completion_ids[row, :n], ref[row // 2, :n]), (name, row)


def test_session_feeds_of_different_lengths_equal_the_whole_conversation(hybrid, tok):
    """A multi-turn session appends 1 and 5 tokens to two rows (fed together, left-padded): each row's next logits
    are those of its whole conversation run from scratch (the padded columns never touch its recurrent state)."""
    name, model = hybrid
    engine = RolloutEngine(model, tok)
    eos = tok.eos_token_id
    params = SamplingParams(num_generations=1, max_completion_length=20, temperature=1.0, seed=2, stop_token_ids=[eos])
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:2]]
    session = engine.start_session(prompt_ids, params)
    try:
        # End both rows' first turn at once: the EOS is what the next forward feeds, after it the appended tokens.
        session.batch.logits = torch.full_like(session.batch.logits, -1e4)
        session.batch.logits[:, eos] = 0.0
        ends = session.advance()
        assert sorted(e.row for e in ends) == [0, 1], name
        appended = {0: [7], 1: [11, 12, 13, 14, 15]}
        for row, ids in appended.items():
            session.append(row, ids)
        session.advance()
        out = session.output()
    finally:
        session.close()
    for row, ids in enumerate(prompt_ids):
        n = int(out.lengths[row])
        full = torch.tensor([ids + out.completion_ids[row, :n].tolist()])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(ids) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, out.completion_ids[row, :n, None]).squeeze(-1)
        sampled = out.generated[row, :n]
        assert sampled[1 + len(appended[row]) :].any(), (name, row)  # the second turn was sampled
        torch.testing.assert_close(out.sampling_logprobs[row, :n][sampled][1:], ref[sampled][1:], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, row=row: f"{name} row {row}: {m}")


def test_cache_row_operations_follow_recurrent_states():
    """expand_into copies a prompt's state to its G rows, select_rows keeps rows, holding_rows puts rows' states back."""
    cache = BucketedKVCache(3, capacity=4, bucket=1, layer_kinds=["recurrent", "attention", "stateless"])
    layer = cache.layers[0]
    assert isinstance(layer, RecurrentStateLayer)
    layer.update_conv_state(torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2), conv_kernel_size=4)
    layer.update_recurrent_state(torch.tensor([[1.0], [2.0]]))
    cache.layers[1].update(torch.zeros(2, 1, 2, 1), torch.zeros(2, 1, 2, 1))
    wide = cache.expand_into(3, 6)
    grown = wide.layers[0]
    assert torch.equal(grown.recurrent_states[0].view(-1), torch.tensor([1.0, 1, 1, 2, 2, 2]))
    assert torch.equal(grown.conv_states[0][3:], layer.conv_states[0][1:].expand(3, -1, -1))
    assert grown.conv_states[0].shape == (6, 3, 4) and (grown.conv_states[0][..., :2] == 0).all()  # left-padded window
    wide.select_rows(torch.tensor([5, 0]))
    assert torch.equal(wide.layers[0].recurrent_states[0].view(-1), torch.tensor([2.0, 1.0]))
    assert wide.nbytes() == 2 * (3 * 4 + 1) * 4 + 2 * 2 * (1 * 6 * 1) * 4
    with wide.holding_rows(torch.tensor([True, False])):
        wide.layers[0].update_recurrent_state(torch.tensor([[9.0], [9.0]]))
    assert torch.equal(wide.layers[0].recurrent_states[0].view(-1), torch.tensor([2.0, 9.0]))


def test_rollout_process_samples_a_hybrid_as_the_engine_does(tok):
    """The rollout process of ``rollout_mode: one_step_off / async`` runs the same engine on its own copy of the
    model: the same seed gives the same tokens and log-probs, and a pushed version is sampled from."""
    model = hybrid_model("qwen3_next", tok)
    params = SamplingParams(num_generations=3, max_completion_length=12, temperature=1.0)
    ids = [tok("hello there").input_ids, tok("The cat sat on a long road").input_ids]
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(3)).item())  # what the process gets
    remote = ProcessBackend(model, tok, params, ProcessSettings(threads=1), torch.device("cpu"), 0)
    try:
        local = RolloutEngine(model, tok, params).generate_ids(ids, params, torch.Generator().manual_seed(seed))
        sampled = remote.generate_ids(ids, params, torch.Generator().manual_seed(3))
        assert torch.equal(local.completion_ids, sampled.completion_ids)
        torch.testing.assert_close(local.sampling_logprobs, sampled.sampling_logprobs, rtol=0, atol=1e-5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02)
        remote.sync_weights(PolicyWeights(model, 2))
        moved = RolloutEngine(model, tok, params).generate_ids(ids, params, torch.Generator().manual_seed(seed))
        newest = remote.generate_ids(ids, params, torch.Generator().manual_seed(3))
        assert torch.equal(newest.completion_ids, moved.completion_ids)
        assert newest.policy_versions.unique().tolist() == [2]
    finally:
        remote.close()
