"""Tools, environments, tool-call parsing, concurrent execution and the chat-template tool suffix."""

from __future__ import annotations

import asyncio
import time

import pytest

from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.tools import (
    EnvironmentPool,
    MalformedCall,
    ParsedTurn,
    ToolCall,
    ToolExecutor,
    ToolResult,
    Toolset,
    append_observation,
    check_tool_chat_template,
    load_environment_factory,
    load_toolset,
    parse_tool_calls,
    render_tool_suffix,
    run_tool_step,
    tool_metrics,
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    await asyncio.sleep(0.01)
    return text.upper()


def fail(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"cannot handle {x}")


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "rested"


async def async_nap(seconds: float) -> str:
    """Sleep asynchronously.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "rested"


def no_doc(a: int) -> int:
    return a


def no_hints(a):
    """Missing hints.

    Args:
        a: Something.
    """
    return a


# ---- toolset -----------------------------------------------------------------------------------


def test_toolset_schema_from_type_hints_and_docstring():
    tools = Toolset([add, shout])
    assert tools.names == ["add", "shout"]
    assert tools["add"].schema["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first integer."},
            "b": {"type": "integer", "description": "The second integer."},
        },
        "required": ["a", "b"],
    }
    assert tools["shout"].is_async and not tools["add"].is_async
    assert [s["function"]["name"] for s in tools.schemas] == ["add", "shout"]


@pytest.mark.parametrize("fn, needle", [(no_doc, "no docstring"), (no_hints, "missing a type hint")])
def test_toolset_rejects_undescribed_functions_clearly(fn, needle):
    with pytest.raises(ConfigError) as err:
        Toolset([fn])
    assert fn.__name__ in str(err.value) and needle in str(err.value) and "Args:" in str(err.value)


def test_toolset_rejects_duplicate_names():
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        Toolset([add, add])


def test_load_toolset_from_specs(tmp_path):
    file = tmp_path / "my_tools.py"
    file.write_text(
        "def mul(a: int, b: int) -> int:\n"
        '    """Multiply.\n\n    Args:\n        a: x\n        b: y\n    """\n'
        "    return a * b\n"
    )
    tools = load_toolset([f"{file}:mul", "tests.tools.test_tools:add", {"name": "python", "timeout": 3}])
    assert tools.names == ["mul", "add", "python"]
    assert tools["mul"].function(a=6, b=7) == 42
    with pytest.raises(ConfigError, match="tool 'tests.tools.test_tools:ad'.*did you mean 'add'"):
        load_toolset(["tests.tools.test_tools:ad"])
    with pytest.raises(ConfigError, match="tool file"):
        load_toolset([f"{tmp_path}/missing.py:f"])
    with pytest.raises(ConfigError, match="unknown tool 'pyton'.*did you mean 'python'"):
        load_toolset(["pyton"])
    with pytest.raises(ConfigError, match="valid options"):
        load_toolset([{"name": "python", "timeot": 3}])


# ---- parsing -----------------------------------------------------------------------------------


def test_parse_qwen_single_and_several_calls():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}\n</tool_call>'
    )
    turn = parse_tool_calls(text, "qwen")
    assert turn.content == "Let me compute."
    assert turn.calls == [
        ToolCall("add", {"a": 1, "b": 2}, '{"name": "add", "arguments": {"a": 1, "b": 2}}'),
        ToolCall("shout", {"text": "hi"}, '{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}'),
    ]
    assert turn.assistant_message()["tool_calls"][1] == {
        "type": "function",
        "function": {"name": "shout", "arguments": {"text": "hi"}},
    }


def test_parse_no_call():
    turn = parse_tool_calls("The answer is 4.", "qwen")
    assert turn == ParsedTurn("The answer is 4.", []) and not turn.has_calls


@pytest.mark.parametrize(
    "body, reason",
    [
        ("<tool_call>\n{'name': 'add', 'arguments': {}}\n</tool_call>", "not valid JSON"),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', 'no "name"'),
        ('<tool_call>\n["add"]\n</tool_call>', "must be an object"),
        ('<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "must be an object"),
        ('<tool_call>\n{"name": "add", "arguments": "a=1"}\n</tool_call>', "not a JSON object"),
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1', "not closed"),
    ],
)
def test_parse_malformed_calls_become_results_not_exceptions(body, reason):
    turn = parse_tool_calls("x " + body, "qwen")
    assert turn.has_calls and len(turn.calls) == 1
    assert isinstance(turn.calls[0], MalformedCall) and reason in turn.calls[0].message


def test_parse_hermes_accepts_python_literals():
    text = "<tool_call>\n{'name': 'add', 'arguments': {'a': 1, 'b': True}}\n</tool_call>"
    assert parse_tool_calls(text, "hermes").calls[0] == ToolCall("add", {"a": 1, "b": True}, text[12:-13])
    assert isinstance(parse_tool_calls(text, "qwen").calls[0], MalformedCall)
    with pytest.raises(ConfigError, match="unknown tool-call format 'qwne'.*did you mean 'qwen'"):
        parse_tool_calls(text, "qwne")


# ---- execution ---------------------------------------------------------------------------------


def _turn(*calls):
    return ParsedTurn("", list(calls))


def test_execute_all_rows_concurrently_with_failure_reasons():
    tools = Toolset([add, shout, fail, nap])
    turns = [
        _turn(ToolCall("add", {"a": 2, "b": 3}), ToolCall("shout", {"text": "hey"})),
        _turn(ToolCall("nope", {})),
        _turn(
            ToolCall("add", {"a": 1}),
            ToolCall("add", {"a": 1, "b": 2, "c": 3}),
            ToolCall("add", {"a": "1", "b": 2}),
        ),
        _turn(ToolCall("fail", {"x": 7}), MalformedCall("{", "the tool call is not valid JSON (x)")),
        _turn(),
        _turn(ToolCall("nap", {"seconds": 0.3}), ToolCall("nap", {"seconds": 0.3})),
    ]
    with ToolExecutor(timeout=5, max_output_chars=100) as executor:
        start = time.perf_counter()
        results = executor.run(turns, tools)
        elapsed = time.perf_counter() - start
    assert elapsed < 0.55  # the two 0.3 s naps ran at the same time
    assert [[r.failure for r in row] for row in results] == [
        [None, None],
        ["unknown_tool"],
        ["bad_arguments", "bad_arguments", "bad_arguments"],
        ["exception", "malformed"],
        [],
        [None, None],
    ]
    assert [r.content for r in results[0]] == ["5", "HEY"]
    assert results[1][0].content == "Error: unknown tool 'nope'; available tools: add, shout, fail, nap"
    assert "missing required argument(s) 'b'" in results[2][0].content
    assert "unexpected argument(s) 'c'" in results[2][1].content
    assert "argument 'a' must be of type integer; got str" in results[2][2].content
    assert results[3][0].content == "Error: fail raised RuntimeError: cannot handle 7"
    assert results[3][1].content.startswith("Error: malformed tool call: the tool call is not valid JSON")
    metrics = tool_metrics(results)
    assert metrics["tools/calls_per_completion"] == 10 / 6
    assert metrics["tools/failed_calls"] == 6
    assert metrics["tools/failed/bad_arguments"] == 3 and metrics["tools/failed/timeout"] == 0


def test_optional_arguments_accept_null():
    def greet(name: str, title: str | None = None) -> str:
        """Greet.

        Args:
            name: Who.
            title: Optional title.
        """
        return f"{title or ''} {name}".strip()

    with ToolExecutor() as executor:
        (row,) = executor.run([_turn(ToolCall("greet", {"name": "Ann", "title": None}))], Toolset([greet]))
    assert row[0].failure is None and row[0].content == "Ann"


def test_execute_timeout_and_truncation():
    def long_text(n: int) -> str:
        """Long text.

        Args:
            n: Length.
        """
        return "y" * n

    tools = Toolset([nap, async_nap, long_text])
    turns = [
        _turn(ToolCall("nap", {"seconds": 2.0})),
        _turn(ToolCall("async_nap", {"seconds": 5.0})),
        _turn(ToolCall("long_text", {"n": 50})),
    ]
    with ToolExecutor(timeout=0.2, max_output_chars=10) as executor:
        start = time.perf_counter()
        results = executor.run(turns, tools)
        assert time.perf_counter() - start < 1.0
    assert [r.failure for row in results for r in row] == ["timeout", "timeout", None]
    assert results[0][0].content == "Error: nap timed out after 0.2 s"
    assert results[2][0].content == "yyyyyyyyyy\n... [output truncated: 40 more characters]"
    assert results[2][0].truncated


def test_execute_per_row_toolsets_and_row_count_check():
    with ToolExecutor() as executor:
        results = executor.run(
            [_turn(ToolCall("add", {"a": 1, "b": 1})), _turn(ToolCall("add", {"a": 1, "b": 1}))],
            [Toolset([add]), Toolset([shout])],
        )
        assert [results[0][0].failure, results[1][0].failure] == [None, "unknown_tool"]
        with pytest.raises(ValueError, match="one toolset per row"):
            executor.run([_turn()], [Toolset(), Toolset()])


def _tool_threads(settle: float = 0.0):
    """The executors' live threads; with ``settle``, after waiting up to that long for them to end
    (idle pool workers exit just after ``close`` returns)."""
    import threading

    deadline = time.perf_counter() + settle
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith("grpo-tool")]
        if not alive or time.perf_counter() >= deadline:
            return alive
        time.sleep(0.01)


def test_executor_threads_start_at_first_run_and_close_stops_them_until_the_next_run():
    before = len(_tool_threads(settle=2.0))
    executor = ToolExecutor()
    assert not executor.running and len(_tool_threads()) == before  # nothing started yet
    (row,) = executor.run([_turn(ToolCall("add", {"a": 1, "b": 2}))], Toolset([add, shout]))
    assert row[0].content == "3" and executor.running and len(_tool_threads()) > before
    executor.close()
    assert not executor.running and len(_tool_threads(settle=2.0)) == before
    executor.close()  # closing twice is harmless
    (row,) = executor.run([_turn(ToolCall("shout", {"text": "hi"}))], Toolset([add, shout]))
    assert row[0].content == "HI"
    executor.close()
    assert len(_tool_threads(settle=2.0)) == before


# ---- environments ------------------------------------------------------------------------------


class Counter:
    """An environment: a counter the model increments; rewarded by reaching the target."""

    created = 0

    def __init__(self):
        type(self).created += 1
        self.value = 0
        self.target = 0

    def reset(self, target: int = 3, **row) -> str:
        self.value, self.target = 0, target
        return f" (target {target})"

    def increment(self, by: int) -> int:
        """Increase the counter.

        Args:
            by: Amount to add.
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return float(self.value == self.target)

    def _private(self):
        return None


class Echo:
    def reset(self, **row):
        return None

    def echo(self, text: str) -> str:
        """Echo.

        Args:
            text: The text.
        """
        return text


def test_environment_pool_single_factory_one_instance_per_rollout_and_reuse():
    Counter.created = 0
    pool = EnvironmentPool(Counter, tools=Toolset([add]))
    rows = [{"prompt": "p", "target": 2}, {"prompt": "p", "target": 5}]
    envs = pool.start(rows)
    assert Counter.created == 2  # the probe instance is reused for the first row
    assert envs[0].instance is not envs[1].instance
    assert envs[0].toolset.names == ["add", "increment"] and envs[0].observation == " (target 2)"
    with ToolExecutor() as executor:
        turns = [_turn(ToolCall("increment", {"by": 2})), _turn(ToolCall("increment", {"by": 1}))]
        results = executor.run(turns, [e.toolset for e in envs])
    assert [r[0].content for r in results] == ["2", "1"]  # each call changed its own rollout's state
    (reward,) = pool.reward_functions()
    assert reward.__name__ == "Counter"
    assert reward(["p"] * 2, ["c"] * 2, [[1]] * 2, environments=envs) == [1.0, 0.0]
    again = pool.start(rows)
    assert Counter.created == 2 and again[0].instance is envs[0].instance and again[0].instance.value == 0


def test_environment_pool_selects_per_row_by_environment_column():
    pool = EnvironmentPool({"count": Counter, "echo": Echo})
    envs = pool.start([{"environment": "echo", "x": 1}, {"environment": "count", "target": 4}])
    assert [type(e.instance) for e in envs] == [Echo, Counter]
    assert envs[0].toolset.names == ["echo"] and envs[1].observation == " (target 4)"
    (reward,) = pool.reward_functions()
    assert reward(environments=[e.instance for e in envs]) == [None, 0.0]
    with pytest.raises(DataError, match="environment='ecko' \\(did you mean 'echo'\\?\\)"):
        pool.start([{"environment": "ecko"}])


def test_environment_without_reset_is_rejected_and_observation_appended():
    class NoReset:
        pass

    with pytest.raises(ConfigError, match="no reset\\(\\) method"):
        EnvironmentPool(NoReset)
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "Count"}]
    out = append_observation(prompt, " to 3")
    assert out[-1]["content"] == "Count to 3" and prompt[-1]["content"] == "Count"
    assert append_observation("Count", " to 3") == "Count to 3"
    loaded = load_environment_factory({"c": "tests.tools.test_tools:Counter"})
    assert list(loaded) == ["c"] and loaded["c"].__qualname__ == "Counter" and callable(loaded["c"]().reset)


# ---- rendering with the built-in tokenizer -----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from grpo_ascend.models.tiny_tokenizer import build_tokenizer

    return build_tokenizer()


def test_tool_tokens_are_single_non_special_tokens(tokenizer):
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1
        assert tokenizer.decode(ids, skip_special_tokens=True) == tag


def test_chat_template_renders_tools_calls_and_responses(tokenizer):
    conversation = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    text = tokenizer.apply_chat_template(conversation, tools=[add], tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "add", "description": "Add two integers."' in text
    assert text.endswith(
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )
    # What the model generates parses back to the call the template rendered.
    generated = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_tool_calls(generated).calls == [
        ToolCall("add", {"a": 2, "b": 3}, '{"name": "add", "arguments": {"a": 2, "b": 3}}')
    ]
    plain = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_tool_suffix_continues_the_conversation_exactly(tokenizer):
    results = [ToolResult("add", "5"), ToolResult("add", "Error: unknown tool 'x'", "unknown_tool")]
    suffix = render_tool_suffix(tokenizer, results)
    assert tokenizer.decode(suffix) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\nError: unknown tool 'x'\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Appending the suffix to a conversation ending with the assistant's call equals rendering it whole.
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
    }
    head = [{"role": "user", "content": "2+3?"}, call]
    head_ids = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False)
    last_eos = len(head_ids) - 1 - head_ids[::-1].index(tokenizer.eos_token_id)
    head_ids = list(head_ids[: last_eos + 1])  # the model's turn ends at EOS
    whole = tokenizer.apply_chat_template(
        head + [r.tool_message() for r in results],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert head_ids + suffix == list(whole)


def test_run_tool_step_parses_runs_and_renders_per_row(tokenizer):
    texts = [
        '<tool_call>\n{"name": "add", "arguments": {"a": 20, "b": 22}}\n</tool_call>',
        "The answer is 42.",
        "<tool_call>\n{oops}\n</tool_call>",
    ]
    with ToolExecutor() as executor:
        steps = run_tool_step(texts, Toolset([add]), executor, tokenizer, parser="qwen")
    assert [s.continues for s in steps] == [True, False, True]
    assert tokenizer.decode(steps[0].suffix_ids) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert steps[1].results == [] and steps[1].suffix_ids == []
    assert steps[2].results[0].failure == "malformed"
    assert "Error: malformed tool call" in tokenizer.decode(steps[2].suffix_ids)
    assert steps[0].messages() == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 20, "b": 22}}}
            ],
        },
        {"role": "tool", "name": "add", "content": "42"},
    ]


def test_check_tool_chat_template(tokenizer):
    check_tool_chat_template(tokenizer)
    plain = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    with pytest.raises(ConfigError, match="does not render tool schemas, tool calls"):
        check_tool_chat_template(tokenizer, {"chat_template": plain})


def test_tool_tokens_extend_the_vocabulary_without_changing_the_rest(tokenizer):
    import torch

    from grpo_ascend.models.tiny_model import build_base_model, build_model
    from grpo_ascend.models.tiny_tokenizer import TOOL_TOKENS

    base = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    assert tokenizer.convert_tokens_to_ids(TOOL_TOKENS) == list(range(base, base + len(TOOL_TOKENS)))
    assert len(tokenizer) == base + len(TOOL_TOKENS)
    full, plain = build_model("tiny", tokenizer), build_base_model("tiny", tokenizer)
    assert full.get_input_embeddings().weight.shape[0] == len(tokenizer)
    for (name, a), (_, b) in zip(full.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a[: b.shape[0]], b), name  # every weight of the BPE vocabulary unchanged
