"""RewardSet: TRL calling convention, async, weights, None, names, loading specs and error handling."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_ascend.errors import ConfigError, DataError, RewardError
from reward_models import (
    BUILTIN_REWARDS,
    AccuracyReward,
    FormatReward,
    OverlongPenalty,
    RewardOutput,
    RewardSet,
    TrainerStateView,
    load_reward_function,
    register_reward,
    reward_name,
)

REPO = Path(__file__).resolve().parents[2]

PROMPTS = ["What is 2 + 2?", "What is 2 + 2?", "What is 3 * 3?", "What is 3 * 3?"]
COMPLETIONS = ["<answer>4</answer>", "<answer>5</answer>", "<answer>9</answer>", "nine"]
IDS = [[1, 2, 3], [1, 2], [4, 5, 6, 7], [8]]
COLUMNS = {"answer": ["4", "4", "9", "9"], "difficulty": [1, 1, 2, 2]}


def score(funcs, columns=COLUMNS, state=None, completions=COMPLETIONS, **kwargs) -> RewardOutput:
    return RewardSet(funcs, **kwargs)(PROMPTS, completions, IDS, columns, trainer_state=state)


# -- TRL-style functions work unchanged ----------------------------------------------------------


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def exact_answer(prompts, completions, answer, **kwargs):
    contents = [re.sub(r"</?answer>", "", c) for c in completions]
    return [1.0 if c == a else 0.0 for c, a in zip(contents, answer)]


def token_count(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def step_reward(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step) + trainer_state.epoch] * len(completions)


def chat_format(completions, **kwargs):
    pattern = r"^<answer>.*?</answer>$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, c) else 0.0 for c in contents]


@pytest.mark.parametrize(
    "func, expected",
    [
        (reward_len, [-2.0, -2.0, -2.0, -16.0]),
        (exact_answer, [1.0, 0.0, 1.0, 0.0]),
        (token_count, [3.0, 2.0, 4.0, 1.0]),
        (step_reward, [7.5] * 4),
    ],
)
def test_trl_style_functions_work_unchanged(func, expected):
    out = score(func, state={"step": 7, "epoch": 0.5})
    assert out.names == [func.__name__]
    assert out.per_function[:, 0].tolist() == expected
    assert out.total.tolist() == expected


def test_kwargs_are_exactly_trl_s():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [0.0] * len(kwargs["completions"])

    columns = {"prompt": PROMPTS, **COLUMNS}  # TRL drops the "prompt" column
    score(spy, columns=columns, state={"step": 3, "epoch": 1.0})
    assert sorted(seen) == [
        "answer",
        "completion_ids",
        "completions",
        "difficulty",
        "prompts",
        "trainer_state",
    ]
    assert seen["prompts"] == PROMPTS and seen["completions"] == COMPLETIONS and seen["completion_ids"] == IDS
    assert seen["answer"] == COLUMNS["answer"] and seen["difficulty"] == [1, 1, 2, 2]
    state = seen["trainer_state"]
    assert state["step"] == state.step == state.global_step == 3 and state.epoch == 1.0


def test_chat_completions_pass_through():
    chat = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    out = RewardSet(chat_format)(prompts, chat, IDS, COLUMNS)
    assert out.total.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_trainer_state_defaults_and_objects():
    assert TrainerStateView(None) == {"step": 0, "epoch": 0.0, "global_step": 0}
    with pytest.raises(AttributeError, match="has no 'lr'"):
        _ = TrainerStateView({"step": 1}).lr

    class State:  # e.g. a transformers TrainerState, passed through as is
        global_step = 11
        epoch = 2.0

    out = score(step_reward, state=State())
    assert out.total.tolist() == [13.0] * 4


def test_each_function_gets_its_own_lists():
    def mutate(completions, **kwargs):
        completions.clear()
        completions.extend(["x"] * 4)
        return [0.0] * 4

    out = score([mutate, reward_len])
    assert out.per_function[:, 1].tolist() == [-2.0, -2.0, -2.0, -16.0]


# -- async ---------------------------------------------------------------------------------------


def test_async_functions_run_concurrently_and_combine():
    a_ready, b_ready = asyncio.Event(), asyncio.Event()

    # Each waits for the other: this only finishes if both run at the same time in one loop.
    async def judge_a(completions, **kwargs):
        a_ready.set()
        await asyncio.wait_for(b_ready.wait(), 5)
        return [1.0] * len(completions)

    async def judge_b(completions, **kwargs):
        b_ready.set()
        await asyncio.wait_for(a_ready.wait(), 5)
        return [2.0] * len(completions)

    out = score([judge_a, token_count, judge_b], reward_weights=[1.0, 0.5, 10.0])
    assert out.names == ["judge_a", "token_count", "judge_b"]
    assert out.per_function.tolist() == [[1.0, 3.0, 2.0], [1.0, 2.0, 2.0], [1.0, 4.0, 2.0], [1.0, 1.0, 2.0]]
    assert out.total.tolist() == [22.5, 22.0, 23.0, 21.5]


def test_async_callable_object_and_partial():
    class Judge:
        async def __call__(self, completions, scale=1.0, **kwargs):
            await asyncio.sleep(0)
            return [scale] * len(completions)

    async def judge(completions, scale, **kwargs):
        return [scale] * len(completions)

    out = score([Judge(), functools.partial(judge, scale=3.0)])
    assert out.names == ["Judge", "judge"]
    assert out.total.tolist() == [4.0] * 4


def test_async_works_inside_a_running_event_loop():
    async def judge(completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    rewards = RewardSet([judge, reward_len])

    async def notebook_cell():  # like calling from Jupyter, where a loop is already running
        return rewards(PROMPTS, COMPLETIONS, IDS, COLUMNS)

    out = asyncio.run(notebook_cell())
    assert out.per_function[:, 0].tolist() == [1.0] * 4


# -- weights, None, names ------------------------------------------------------------------------


def const(value):
    def fn(completions, **kwargs):
        return [value] * len(completions)

    fn.__name__ = f"const_{value}"
    return fn


@pytest.mark.parametrize(
    "weights, expected",
    [
        (None, 3.0),
        ([1.0, 1.0], 3.0),
        ([2.0, 0.5], 3.0),
        ([0.0, 1.0], 2.0),
        ([-1.0, 0.25], -0.5),
        (torch.tensor([3.0, 1.0]), 5.0),
    ],
)
def test_weights_apply(weights, expected):
    out = score([const(1.0), const(2.0)], reward_weights=weights)
    assert out.total.tolist() == [expected] * 4


def test_none_is_nan_and_ignored_in_the_sum(caplog):
    def sometimes(completions, **kwargs):
        return [1.0, None, None, 0.5]

    def other(completions, **kwargs):
        return [2.0, 3.0, None, None]

    with caplog.at_level(logging.WARNING, logger="reward_models"):
        rewards = RewardSet([sometimes, other], reward_weights=[1.0, 2.0])
        out = rewards(PROMPTS, COMPLETIONS, IDS, COLUMNS)
        rewards(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    per = out.per_function
    assert per.dtype == torch.float32 and per.shape == (4, 2)
    assert torch.isnan(per).tolist() == [[False, False], [True, False], [True, True], [False, True]]
    assert out.total.tolist() == [5.0, 6.0, 0.0, 0.5]
    assert out.all_none == 1
    warned = [r.getMessage() for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    assert len(warned) == 1  # once, in TRL 1.16's words, with the first such completion's kwargs as TRL shows them
    kwargs = {"answer": "9", "difficulty": 2, "prompt": "What is 3 * 3?", "completion": "<answer>9</answer>"}
    assert warned[0].startswith(f"All reward functions returned None for the following kwargs:\n{kwargs}\nPlease "
                                "ensure that at least one reward function returns a valid reward. (1 of 4 "
                                "completions of this batch, reward functions sometimes, other;")


@pytest.mark.parametrize(
    "funcs, expected",
    [
        ([reward_len], ["reward_len"]),
        ([reward_len, reward_len, reward_len], ["reward_len", "reward_len_2", "reward_len_3"]),
        ([lambda completions, **kw: [0.0] * len(completions)], ["lambda"]),
        ([functools.partial(functools.partial(reward_len))], ["reward_len"]),
        ([FormatReward(), "format", "accuracy"], ["format", "format_2", "accuracy"]),
        ([{"name": "overlong", "max_completion_length": 8, "buffer": 2}], ["overlong"]),
    ],
)
def test_names(funcs, expected):
    assert RewardSet(funcs).names == expected


def test_name_of_callable_object():
    class MyScorer:
        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    assert reward_name(MyScorer()) == "MyScorer"


def test_empty_batch_and_device_placement():
    rewards = RewardSet([reward_len, token_count], device="meta")
    out = rewards([], [], [], {})
    assert out.per_function.shape == (0, 2) and out.total.shape == (0,)
    out = rewards(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert out.per_function.device.type == "meta" and out.total.device.type == "meta"
    assert out.per_function.is_contiguous() and out.total.is_contiguous()


def test_metrics():
    def half(completions, **kwargs):
        return [1.0, None, 3.0, None]

    out = score([half, const(2.0)])
    m = out.metrics()
    assert m["rewards/half/mean"] == 2.0 and m["rewards/half/std"] == pytest.approx(math.sqrt(2.0))
    assert m["rewards/const_2.0/mean"] == 2.0 and m["rewards/const_2.0/std"] == 0.0
    assert m["reward"] == pytest.approx(3.0) and m["rewards/half/errors"] == 0.0
    assert m["rewards/half/seconds"] >= 0.0


# -- robustness: raising functions ---------------------------------------------------------------


def fails_on_nine(completions, **kwargs):
    return [1.0 / (0 if "9" in c else 1) for c in completions]


def test_raising_function_names_function_exception_and_index():
    with pytest.raises(RewardError) as info:
        score([reward_len, fails_on_nine])
    message = str(info.value)
    for part in (
        "'fails_on_nine'",
        "ZeroDivisionError",
        "completion 2",
        "(of 4",
        "'<answer>9</answer>'",
        "reward_errors: zero",
    ):
        assert part in message


def test_reward_errors_zero_scores_failing_completions_zero_and_counts(caplog):
    rewards = RewardSet([fails_on_nine, reward_len], reward_errors="zero")
    with caplog.at_level(logging.WARNING, logger="reward_models"):
        first = rewards(PROMPTS, COMPLETIONS, IDS, COLUMNS)
        second = rewards(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert first.per_function[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert first.error_counts == {"fails_on_nine": 1, "reward_len": 0}
    assert second.error_counts == {"fails_on_nine": 1, "reward_len": 0}
    assert rewards.total_error_counts == {"fails_on_nine": 2, "reward_len": 0}
    warnings = [r for r in caplog.records if "fails_on_nine" in r.getMessage()]
    assert len(warnings) == 1 and "completion 2" in warnings[0].getMessage()


def test_failure_that_depends_on_the_whole_batch():
    def needs_single(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch too big")
        return [1.0]

    with pytest.raises(
        RewardError,
        match=r"'needs_single' raised RuntimeError: batch too big on the batch of 4 completions, but on none",
    ):
        score(needs_single)
    out = score(needs_single, reward_errors="zero")
    assert out.per_function[:, 0].tolist() == [0.0] * 4 and out.error_counts["needs_single"] == 4


def test_async_raising_function_is_located_too():
    async def flaky(completions, **kwargs):
        if any(c == "nine" for c in completions):
            raise ValueError("cannot judge")
        return [0.5] * len(completions)

    with pytest.raises(RewardError, match=r"'flaky' raised ValueError: cannot judge on completion 3"):
        score(flaky)
    out = score(flaky, reward_errors="zero")
    assert out.total.tolist() == [0.5, 0.5, 0.5, 0.0] and out.error_counts == {"flaky": 1}


def test_config_error_inside_a_function_always_stops():
    with pytest.raises(RewardError, match="'accuracy': accuracy needs the reference answers"):
        score("accuracy", columns={"difficulty": [1, 1, 2, 2]}, reward_errors="zero")


# -- robustness: bad outputs ---------------------------------------------------------------------


def returning(value):
    def bad(completions, **kwargs):
        return value

    return bad


@pytest.mark.parametrize(
    "value, message",
    [
        ([1.0, 2.0, 3.0], "'bad' returned 3 values for 4 completions"),
        ([1.0] * 5, "'bad' returned 5 values for 4 completions"),
        (1.0, "'bad' returned float; expected a list of 4 values"),
        (None, "'bad' returned NoneType; expected a list of 4 values"),
        ("1234", "'bad' returned str"),
        ({0: 1.0}, "'bad' returned dict"),
        ({1.0, 2.0, 3.0, 4.0}, "'bad' returned set"),
        ([1.0, "2.0", 3.0, 4.0], r"'bad' returned a non-numeric value '2.0' \(str\) for completion 1"),
        ([1.0, 2.0, [3.0], 4.0], r"non-numeric value \[3.0\] \(list\) for completion 2"),
        ([1.0, 2.0, 3.0, float("nan")], "'bad' returned nan for completion 3; rewards must be finite"),
        ([float("inf"), 2.0, 3.0, 4.0], "'bad' returned inf for completion 0"),
        ([1.0, -math.inf, 3.0, 4.0], "'bad' returned -inf for completion 1"),
        (torch.ones(4, 1), r"'bad' returned a tensor of shape \(4, 1\)"),
        (np.ones((2, 2)), r"'bad' returned an array of shape \(2, 2\)"),
    ],
)
@pytest.mark.parametrize("mode", ["raise", "zero"])
def test_bad_outputs_give_clear_errors(value, message, mode):
    with pytest.raises(RewardError, match=message):
        score(returning(value), reward_errors=mode)


@pytest.mark.parametrize(
    "value",
    [
        (1.0, 0.0, 1.0, 0.0),
        [True, False, True, False],
        [1, 0, 1, 0],
        np.array([1.0, 0.0, 1.0, 0.0]),
        torch.tensor([1.0, 0.0, 1.0, 0.0]),
        [np.float32(1.0), np.int64(0), torch.tensor(1.0), 0.0],
        (x for x in [1.0, 0.0, 1.0, 0.0]),
    ],
)
def test_accepted_output_types(value):
    assert score(returning(value)).total.tolist() == [1.0, 0.0, 1.0, 0.0]


# -- robustness: signatures, timeouts, inputs ----------------------------------------------------


@pytest.mark.parametrize(
    "func, message",
    [
        (lambda completions, answer: [0.0] * 4, "unexpected keyword argument 'prompts'"),
        (lambda completions, ground_truth, **kw: [0.0] * 4, "missing a required argument: 'ground_truth'"),
    ],
)
def test_functions_must_take_trl_keywords(func, message):
    with pytest.raises(RewardError, match=rf"'lambda' cannot be called .*{message}.*\*\*kwargs"):
        score(func, reward_errors="zero")


def test_sync_timeout():
    release = threading.Event()

    def slow(completions, **kwargs):
        release.wait(10)
        return [1.0] * len(completions)

    try:
        start = time.perf_counter()
        with pytest.raises(
            RewardError, match=r"'slow' did not return within reward_timeout=0.05s .*cannot be killed"
        ):
            score([reward_len, slow], reward_timeout=0.05)
        out = score([reward_len, slow], reward_timeout=0.05, reward_errors="zero")
        assert time.perf_counter() - start < 2.0
        assert out.per_function[:, 1].tolist() == [0.0] * 4 and out.error_counts["slow"] == 4
    finally:
        release.set()


def test_timeout_while_locating_a_failure_zeroes_the_batch():
    release = threading.Event()

    def picky(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("batch")
        if completions[0] == "nine":
            release.wait(10)
        return [1.0]

    try:
        with pytest.raises(RewardError, match="'picky' did not return within reward_timeout"):
            score(picky, reward_timeout=0.05)
        out = score(picky, reward_timeout=0.05, reward_errors="zero")
        assert out.per_function[:, 0].tolist() == [0.0] * 4 and out.error_counts == {"picky": 4}
    finally:
        release.set()


def test_async_timeout_cancels():
    cancelled = threading.Event()

    async def slow(completions, **kwargs):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"'slow' did not return within reward_timeout=0.05s"):
        score(slow, reward_timeout=0.05)
    assert cancelled.wait(2)


def test_fast_functions_are_unaffected_by_timeout():
    out = score([reward_len, token_count], reward_timeout=5)
    assert out.per_function[:, 1].tolist() == [3.0, 2.0, 4.0, 1.0]


@pytest.mark.parametrize(
    "prompts, ids, columns, message",
    [
        (PROMPTS[:3], IDS, COLUMNS, "got 3 prompts for 4 completions"),
        (PROMPTS, IDS[:2], COLUMNS, "got 2 completion_ids for 4 completions"),
        (PROMPTS, IDS, {"answer": ["4"]}, "column 'answer' has 1 entries for 4 completions"),
        (PROMPTS, IDS, {"answer": "4499"}, "column 'answer' has str entries"),
        (PROMPTS, IDS, {"completions": COMPLETIONS}, "column 'completions' clashes"),
    ],
)
def test_malformed_batches(prompts, ids, columns, message):
    with pytest.raises(DataError, match=message):
        RewardSet(reward_len)(prompts, COMPLETIONS, ids, columns)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reward_funcs": []}, "reward_funcs is empty"),
        (
            {"reward_funcs": [reward_len], "reward_weights": [1.0, 2.0]},
            "reward_weights has 2 values for 1 reward functions",
        ),
        (
            {"reward_funcs": [reward_len], "reward_weights": [float("nan")]},
            "weight of 'reward_len' must be a finite number",
        ),
        ({"reward_funcs": [reward_len], "reward_errors": "zeros"}, "did you mean 'zero'"),
        ({"reward_funcs": [reward_len], "reward_timeout": 0}, "reward_timeout must be a positive number"),
        ({"reward_funcs": [reward_len], "reward_timeout": True}, "reward_timeout must be a positive number"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        RewardSet(**kwargs)


# -- loading specs -------------------------------------------------------------------------------


@pytest.fixture()
def user_files(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            def shout(completions, **kwargs):
                return [float(c.isupper()) for c in completions]

            def scaled(completions, factor=1.0, **kwargs):
                return [factor * len(c) for c in completions]

            class Counter:
                def __init__(self, letter):
                    self.letter = letter
                def __call__(self, completions, **kwargs):
                    return [float(c.count(self.letter)) for c in completions]

            NOT_CALLABLE = 3
            """
        )
    )
    (tmp_path / "broken.py").write_text("import does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_load_module_file_and_options(user_files):
    file = user_files / "my_rewards_mod.py"
    specs = [
        "my_rewards_mod:shout",
        f"{file}:scaled",
        {"name": f"{file}:scaled", "factor": 2.0},
        {"name": "my_rewards_mod:Counter", "letter": "a"},
    ]
    out = RewardSet(specs)(["p", "p"], ["AB", "aaa"], [[1], [2]], {})
    assert out.names == ["shout", "scaled", "scaled_2", "Counter"]
    assert out.per_function.tolist() == [[1.0, 2.0, 4.0, 0.0], [0.0, 3.0, 6.0, 3.0]]
    assert load_reward_function(f"{file}:shout") is load_reward_function(f"{file}:shout")


@pytest.mark.parametrize(
    "spec, kind",
    [
        ("accuracy", AccuracyReward),
        ({"name": "accuracy", "answer_column": "solution"}, AccuracyReward),
        ("format", FormatReward),
        ({"name": "overlong", "max_completion_length": 256, "buffer": 64}, OverlongPenalty),
    ],
)
def test_load_builtins(spec, kind):
    assert isinstance(load_reward_function(spec), kind)


def test_load_builtin_options_as_keywords():
    fn = load_reward_function("overlong", max_completion_length=10, buffer=4)
    assert (fn.max_completion_length, fn.buffer) == (10, 4)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("acuracy", "unknown reward 'acuracy' \\(did you mean 'accuracy'\\?\\)"),
        (
            {"name": "overlong", "max_completion_length": 8, "bufer": 2},
            "unknown option 'bufer' for reward 'overlong' \\(did you mean 'buffer'\\?\\)",
        ),
        ("overlong", "reward 'overlong' needs the option\\(s\\) max_completion_length, buffer"),
        ({"name": "format", "pattern": "(unclosed"}, "not a valid regular expression"),
        ({"answer_column": "x"}, "needs a 'name' key"),
        ("no_such_file.py:fn", "reward file 'no_such_file.py' not found"),
        ("my_rewards_mod.py", "name the function in the file, as my_rewards_mod.py:function_name"),
        ("my_rewards_mod:shou", "has no 'shou' \\(did you mean 'shout'\\?\\)"),
        ("my_rewards_mod:NOT_CALLABLE", "is a int, not a callable"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("broken:fn", "importing module 'broken' failed: ModuleNotFoundError"),
        ({"name": "my_rewards_mod:Counter"}, "needs the option\\(s\\) letter"),
        (42, "a reward must be"),
        ({"name": "reward_model"}, "needs the option model"),
    ],
)
def test_load_errors(user_files, spec, message):
    with pytest.raises(ConfigError, match=message):
        load_reward_function(spec)


def test_broken_file_error_names_the_file(user_files):
    with pytest.raises(ConfigError, match=r"could not load reward file '.*broken.py': ModuleNotFoundError"):
        load_reward_function(f"{user_files / 'broken.py'}:fn")


def test_register_reward():
    @register_reward("test_bonus")
    def bonus(completions, amount=1.0, **kwargs):
        return [amount] * len(completions)

    try:
        assert "test_bonus" in BUILTIN_REWARDS
        out = score([{"name": "test_bonus", "amount": 3.0}, "test_bonus"])
        assert out.names == ["bonus", "bonus_2"] and out.total.tolist() == [4.0] * 4
        with pytest.raises(ConfigError, match="already registered"):
            register_reward("test_bonus")(bonus)
    finally:
        BUILTIN_REWARDS.pop("test_bonus", None)


# -- the recipe's example file -------------------------------------------------------------------


def test_recipe_reward_file():
    path = REPO / "recipes" / "rewards" / "my_reward.py"
    rewards = RewardSet(
        [
            f"{path}:my_reward",
            f"{path}:answer_only",
            {"name": f"{path}:close_answer", "decay_steps": 10},
            {"name": f"{path}:brevity", "max_tokens": 2},
        ],
    )
    chat = [
        [{"role": "assistant", "content": c}] for c in ["<answer>4</answer>", "<answer>7</answer> hi", "no"]
    ]
    out = rewards(
        ["q"] * 3, chat, [[1, 2], [1, 2, 3], [1] * 12], {"answer": ["4", "4", None]}, {"step": 5, "epoch": 0}
    )
    assert out.names == ["my_reward", "answer_only", "close_answer", "brevity"]
    per = out.per_function
    assert per[:2, 0].tolist() == [1.0, 0.25] and math.isnan(per[2, 0])
    assert per[:, 1].tolist() == [1.0, 0.0, 0.0]
    assert per[:2, 2].tolist() == pytest.approx([0.5, 0.125]) and math.isnan(per[2, 2])
    assert per[:, 3].tolist() == pytest.approx([0.0, -0.01, -0.1])


def test_recipe_custom_reward_yaml_names_a_function_that_exists():
    import yaml

    recipe = yaml.safe_load((REPO / "recipes" / "custom_reward.yaml").read_text())
    specs = [
        s.replace("recipes/", f"{REPO}/recipes/", 1) if isinstance(s, str) and ".py:" in s else s
        for s in recipe["reward_funcs"]
    ]
    rewards = RewardSet(specs, reward_weights=recipe["reward_weights"])
    out = rewards(["q"], ["<answer>5</answer>"], [[1]], {"answer": ["4"]})
    assert out.total.tolist() == [0.5 * 0.5]


def test_sync_callable_returning_a_coroutine_is_awaited():
    async def judge(completions):
        await asyncio.sleep(0)
        return [2.0] * len(completions)

    def wrapper(completions, **kwargs):  # e.g. a decorator that hides the async def
        return judge(completions)

    assert score(wrapper).total.tolist() == [2.0] * 4
    assert score(wrapper, reward_timeout=5).total.tolist() == [2.0] * 4


def test_nothing_evaluates_text_as_code():
    import ast

    for path in sorted((REPO / "reward_models").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        calls = {
            node.func.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        assert not calls & {"eval", "exec", "compile", "__import__"}, path
