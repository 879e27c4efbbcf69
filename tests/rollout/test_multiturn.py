"""Multi-turn tool-calling rollouts: exact sequences and masks, cache continuation = from-scratch
conversation, greedy parity with ``generate``, and tool-free rows equal to the single-turn engine.

The scripted model (tests/support/multiturn_scripts.py) is the tiny Qwen2 (weights perturbed so free decoding varies) whose logits are
overridden at chosen absolute positions: what it emits there depends only on the position, so it
behaves identically in the cached loop, in one forward over the whole conversation and in
``generate``. Prompts of very different lengths get disjoint scripts. Tokens it must never emit
where it decodes freely (a tool-call tag, the end of a turn) are banned there, so a sampled
rollout's calls and lengths do not depend on what was sampled.
"""

from __future__ import annotations

import pytest
import torch
from helpers import perturb_weights
from multiturn_scripts import CALL, ScriptedQwen2, add, token_ids
from transformers import AutoTokenizer

from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.multiturn import MultiTurnEngine, ToolSettings
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.tools import ToolExecutor, ToolResult, Toolset, render_tool_suffix


@pytest.fixture(scope="module")
def scripted(tiny_model_dir):
    model = perturb_weights(ScriptedQwen2.from_pretrained(tiny_model_dir).eval())
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _setup(model, tok, answer_free: bool, b_free: bool = False, banned: tuple[int, ...] = ()):
    """Two prompts: A calls add(2, 3) then answers; B (far longer) answers at once; ``banned`` tokens
    are never emitted where the model decodes freely. Returns (prompts, A's call, the tool suffix,
    A's scripted answer, the toolset)."""
    tools = Toolset([add])
    prompts = [
        [{"role": "user", "content": "add two and three"}],
        [{"role": "user", "content": "just say ok " + "word " * 50}],
    ]
    lens = [len(token_ids(tok, tok.apply_chat_template(p, tools=tools.schemas, add_generation_prompt=True, tokenize=False)))
            for p in prompts]
    eos = tok.eos_token_id
    call = token_ids(tok, CALL) + [eos]
    suffix = render_tool_suffix(tok, [ToolResult("add", "5")])
    answer = token_ids(tok, "five") + ([] if answer_free else [eos])
    script = {}
    for k, t in enumerate(call):
        script[lens[0] + k] = t
    start2 = lens[0] + len(call) + len(suffix)
    for k, t in enumerate(answer):
        script[start2 + k] = t
    for k, t in enumerate([] if b_free else token_ids(tok, "ok") + [eos]):
        script[lens[1] + k] = t
    model.script, model.banned = script, banned
    assert lens[1] > start2 + 60  # disjoint scripts
    return prompts, call, suffix, answer, tools


def _multi(model, tok, tools, limit=None, max_output_chars=4096):
    settings = ToolSettings(Toolset(tools), ToolExecutor(timeout=5, max_output_chars=max_output_chars),
                            max_tool_calling_iterations=limit)
    return MultiTurnEngine(RolloutEngine(model, tok), settings)


def test_scripted_tool_call_gives_exact_sequence_masks_and_messages(scripted):
    model, tok = scripted
    prompts, call, suffix, answer, tools = _setup(model, tok, answer_free=False)
    engine = _multi(model, tok, tools)
    batch = engine.generate(prompts, SamplingParams(max_prompt_length=1024, num_generations=2, max_completion_length=80, temperature=0.0))
    expected = call + suffix + answer
    n = len(expected)
    for r in (0, 1):
        assert batch.completion_ids[r, :n].tolist() == expected
        assert batch.completion_mask[r].tolist() == [1] * n + [0] * (batch.completion_ids.shape[1] - n)
        tool = [1] * len(call) + [0] * len(suffix) + [1] * len(answer)
        assert batch.tool_mask[r, :n].tolist() == tool and batch.tool_mask[r, n:].sum() == 0
        lp = batch.sampling_logprobs[r, :n]
        assert (lp[len(call) : len(call) + len(suffix)] == 0).all()
        assert (lp.abs() < 1e-3).all()  # forced tokens
        assert batch.messages[r] == [
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "name": "add", "content": "5"},
            {"role": "assistant", "content": "five"},
        ]
        assert batch.num_turns[r] == 2 and not batch.truncated[r]
    ok = token_ids(tok, "ok") + [tok.eos_token_id]
    for r in (2, 3):
        assert batch.completion_ids[r, : len(ok)].tolist() == ok
        assert batch.completion_mask[r].sum() == len(ok) == batch.tool_mask[r].sum()
        assert batch.messages[r] == [{"role": "assistant", "content": "ok"}] and batch.num_turns[r] == 1
    m = batch.tool_metrics
    assert m["tools/calls_per_completion"] == 0.5 and m["tools/turns_per_completion"] == 1.5
    assert m["tools/failed_calls"] == 0
    assert batch.decode_batch_sizes == [4, 2]  # B's rows finish first and are compacted away
    assert batch.completion_texts[0] == tok.decode(expected, skip_special_tokens=True)


def test_iteration_and_length_limits(scripted):
    model, tok = scripted
    prompts, call, suffix, answer, tools = _setup(model, tok, answer_free=False)
    params = SamplingParams(max_prompt_length=1024, num_generations=1, max_completion_length=80, temperature=0.0)
    batch = _multi(model, tok, tools, limit=0).generate(prompts[:1], params)
    assert batch.completion_mask[0].sum() == len(call) and batch.tool_mask[0].sum() == len(call)
    assert batch.tool_metrics["tools/iteration_limited"] == 1 and batch.tool_metrics["tools/calls_per_completion"] == 0
    assert "tool_calls" in batch.messages[0][0] and len(batch.messages[0]) == 1
    short = SamplingParams(max_prompt_length=1024, num_generations=1, max_completion_length=len(call) + len(suffix), temperature=0.0)
    batch = _multi(model, tok, tools).generate(prompts[:1], short)
    assert batch.truncated[0] and batch.completion_mask[0].sum() == len(call)
    assert batch.tool_metrics["tools/length_limited"] == 1
    cut = SamplingParams(max_prompt_length=1024, num_generations=1, max_completion_length=len(call) + len(suffix) + 2, temperature=0.0)
    batch = _multi(model, tok, tools).generate(prompts[:1], cut)
    assert batch.truncated[0] and batch.completion_mask[0].sum() == len(call) + len(suffix) + 2


def _tool_call_tag(tok) -> int:
    return tok.convert_tokens_to_ids("<tool_call>")


def test_cache_continuation_equals_whole_conversation_from_scratch(scripted):
    """Free decoding never opens a call or ends a turn (banned): A's rows call once and decode to the
    length limit after it, B's rows never call and are still decoding when A's take their tool step
    -- whatever was sampled (free, these failed for 9 of 40 seeds)."""
    model, tok = scripted
    stops = tuple(RolloutEngine(model, tok).eos_token_ids)
    prompts, call, suffix, answer, tools = _setup(model, tok, answer_free=True, b_free=True,
                                                  banned=(_tool_call_tag(tok), *stops))
    params = SamplingParams(max_prompt_length=1024, num_generations=3, max_completion_length=110, temperature=1.0, seed=3)
    batch = _multi(model, tok, tools).generate(prompts, params)
    assert batch.tool_metrics["tools/calls_per_completion"] == 0.5
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    lp = batch.prompt_ids.shape[1]
    ref = torch.log_softmax(logits[:, lp - 1 : -1], -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    gen = batch.tool_mask.bool()
    torch.testing.assert_close(batch.sampling_logprobs[gen], ref[gen], atol=1e-5, rtol=1e-5)  # fp32 order differs by CPU: 1.1e-5 seen at |lp| 4.5
    assert (batch.sampling_logprobs[~gen] == 0).all()
    free = gen[:3, len(call) + len(suffix) + len(answer):]
    assert free.sum() > 30  # the free part of A's second turn was really sampled
    assert (batch.sampling_logprobs[:3, len(call) + len(suffix) + len(answer):][free] < -1e-3).any()
    # B's rows were still decoding when A's rows took their tool step (one mixed, padded forward)
    assert batch.completion_mask[3:].sum(1).min() > len(call)


def test_greedy_final_turn_equals_generate_on_whole_conversation(scripted):
    model, tok = scripted
    prompts, call, suffix, answer, tools = _setup(model, tok, answer_free=True)
    max_new = 120
    batch = _multi(model, tok, tools).generate(prompts[:1], SamplingParams(
        max_prompt_length=1024, num_generations=1, max_completion_length=max_new, temperature=0.0))
    n = int(batch.completion_mask[0].sum())
    head = len(call) + len(suffix)
    assert n - head > 20 and batch.tool_mask[0, head:n].all()
    prompt = batch.prompt_ids[0][batch.prompt_mask[0].bool()]
    context = torch.cat([prompt, batch.completion_ids[0, :head]]).unsqueeze(0)
    with torch.no_grad():
        out = model.generate(context, attention_mask=torch.ones_like(context), max_new_tokens=max_new - head,
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert out[0, context.shape[1]:][: n - head].tolist() == batch.completion_ids[0, head:n].tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_without_calls_equal_single_turn_engine(scripted, temperature):
    """No row opens a call (the tag is banned; sampled freely, 4 of 40 seeds made one at temperature 1)."""
    model, tok = scripted
    model.script, model.banned = {}, (_tool_call_tag(tok),)
    prompts = ["the model answer", "a question about reward and policy values"]
    # shared_prefix=False: the multi-turn rollout decodes with the plain KV cache, so the single-turn
    # engine's log-probs match it to the last bit only on that cache (the shared prefix agrees to ~3e-6).
    params = SamplingParams(max_prompt_length=1024, num_generations=3, max_completion_length=24, temperature=temperature, seed=5,
                            stop_token_ids=[token_ids(tok, "the")[0]], shared_prefix=False)
    single = RolloutEngine(model, tok).generate(prompts, params)
    multi = _multi(model, tok, Toolset([add])).generate(prompts, params)
    assert multi.tool_metrics["tools/calls_per_completion"] == 0
    torch.testing.assert_close(multi.completion_ids, single.completion_ids)
    torch.testing.assert_close(multi.completion_mask, single.completion_mask)
    torch.testing.assert_close(multi.tool_mask, single.completion_mask)
    torch.testing.assert_close(multi.sampling_logprobs, single.sampling_logprobs, atol=1e-6, rtol=0)
    assert multi.truncated.tolist() == single.truncated.tolist()
    assert multi.completion_texts == single.completion_texts
    assert multi.decode_batch_sizes == single.decode_batch_sizes


def shout(n: int) -> str:
    """Return n x's.

    Args:
        n: How many.
    """
    return "x" * n


CASES = {
    "malformed": ('<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>', 1, "malformed",
                  ["Error: malformed tool call"]),
    "two_calls": (CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call>', 2, None,
                  ["<tool_response>\n5\n</tool_response>", "<tool_response>\n9\n</tool_response>"]),
    "unknown_tool": ('<tool_call>\n{"name": "ad", "arguments": {"a": 1}}\n</tool_call>', 1, "unknown_tool",
                     ["unknown tool 'ad'"]),
    "long_output": ('<tool_call>\n{"name": "shout", "arguments": {"n": 50}}\n</tool_call>', 1, None,
                    ["x" * 20 + "\n... [output truncated: 30 more characters]"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_failed_several_and_truncated_calls_are_answered_and_decoding_goes_on(scripted, case):
    model, tok = scripted
    text, n_calls, failure, expected = CASES[case]
    tools = Toolset([add, shout])
    prompt = [{"role": "user", "content": "add two and three"}]
    start = len(token_ids(tok, tok.apply_chat_template(prompt, tools=tools.schemas, add_generation_prompt=True,
                                                  tokenize=False)))
    call = token_ids(tok, text) + [tok.eos_token_id]
    model.script, model.banned = {start + k: t for k, t in enumerate(call)}, ()
    engine = _multi(model, tok, tools, max_output_chars=20)
    batch = engine.generate([prompt], SamplingParams(max_prompt_length=1024, num_generations=1,
                                                     max_completion_length=len(call) + 120, temperature=0.0))
    ids, tool = batch.completion_ids[0], batch.tool_mask[0]
    assert ids[: len(call)].tolist() == call and tool[: len(call)].all()
    n_tool = int((batch.completion_mask[0] - tool).sum())
    response = tok.decode(ids[len(call) : len(call) + n_tool].tolist(), skip_special_tokens=False)
    for piece in expected:
        assert piece in response
    assert response.endswith("<|im_start|>assistant\n")
    assert tool[len(call) + n_tool :].sum() > 0  # the model decoded after the response
    m = batch.tool_metrics
    assert m["tools/calls_per_completion"] == n_calls
    assert m["tools/failed_calls"] == (1 if failure else 0)
    if failure:
        assert m[f"tools/failed/{failure}"] == 1
    assert m["tools/truncated"] == (case == "long_output")
    roles = [msg["role"] for msg in batch.messages[0]]
    assert roles[:1 + n_calls] == ["assistant"] + ["tool"] * n_calls and roles[-1] == "assistant"
