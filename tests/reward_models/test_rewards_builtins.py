"""Built-in rewards on table-driven cases: answer extraction, number parsing, accuracy, format,
length penalty and DAPO overlong shaping."""

from __future__ import annotations

import pytest

from grpo_ascend.errors import ConfigError, RewardError
from reward_models import (
    AccuracyReward,
    FormatReward,
    LengthPenalty,
    OverlongPenalty,
    answers_match,
    completion_text,
    extract_answer,
    parse_number,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>42</answer>", "42"),
        ("<answer> 42 </answer>", "42"),
        ("<think>maybe 3</think><answer>7</answer>", "7"),
        ("<answer>1</answer> no wait <answer>2</answer>", "2"),
        ("<ANSWER>5</ANSWER>", "5"),
        ("<answer>\n12\n</answer>", "12"),
        ("<answer>\\boxed{3/4}</answer>", "3/4"),
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{ 2 }", "2"),
        ("\\boxed{\\text{x}^{2}}", "\\text{x}^{2}"),
        ("\\boxed 5 dollars", "5"),
        ("\\fbox{8}", "8"),
        ("\\boxed{1} and \\boxed{unclosed", "1"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("#### 1,000\n", "1,000"),
        ("<answer>unclosed", None),
        ("just 42", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", 42.0),
        ("-3", -3.0),
        ("+3", 3.0),
        ("- 3", -3.0),
        ("1000.0", 1000.0),
        ("1,000", 1000.0),
        ("1,234,567.5", 1234567.5),
        ("$1,000", 1000.0),
        ("\\$1,000.00", 1000.0),
        ("$5$", 5.0),
        (".5", 0.5),
        ("5.", 5.0),
        ("1e3", 1000.0),
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("3 / -4", -0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{3}{4}", 0.75),
        ("-\\frac{3}{4}", -0.75),
        ("\\frac{-3}{4}", -0.75),
        ("\\frac34", 0.75),
        ("50%", 50.0),
        ("50\\%", 50.0),
        ("90^\\circ", 90.0),
        ("1{,}000", 1000.0),
        ("\\text{12}", 12.0),
        ("7.", 7.0),
        # not one number
        ("1,5", None),
        ("1,00", None),
        ("2+3", None),
        ("3/0", None),
        ("\\frac{3}{0}", None),
        ("1e999", None),
        ("1e99999", None),
        ("inf", None),
        ("nan", None),
        ("forty-two", None),
        ("__import__('os').system('echo hi')", None),
        ("1 2", None),
        ("", None),
        ("9" * 100, None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    "predicted, reference, expected",
    [
        ("1000", "1,000", True),
        ("1000.0", "1000", True),
        ("$1,000", "1000", True),
        ("0.75", "3/4", True),
        ("\\frac{3}{4}", "0.75", True),
        ("0.333333333", "1/3", True),
        ("0.3333", "1/3", False),
        ("50%", "50", True),
        ("-3", "3", False),
        ("1000001", "1000000", False),
        ("\\sqrt{2}", "\\sqrt{2}", True),
        ("\\sqrt{2} ", "\\sqrt {2}", True),
        ("\\sqrt{3}", "\\sqrt{2}", False),
        ("x", "5", False),
        ("5", "x", False),
        ("", "", False),
    ],
)
def test_answers_match(predicted, reference, expected):
    assert answers_match(predicted, reference) is expected


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("<answer>4</answer>", "4", 1.0),
        ("<answer>4.0</answer>", 4, 1.0),
        ("<answer>5</answer>", "4", 0.0),
        ("The answer is \\boxed{1,000}", "#### 1000", 1.0),
        ("so #### 72", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
        ("\\boxed{\\frac{1}{2}}", "The probability is $\\boxed{\\dfrac{1}{2}}$.", 1.0),
        ("<answer>$18</answer>", "18", 1.0),
        ("I think it's 4", "4", 0.0),  # no extractable answer
        ("<answer>4 or 5</answer>", "4", 0.0),  # hedging is not an answer
        ("<answer>4</answer>", None, None),  # no reference: not applicable
        ("<answer>4</answer>", "  ", None),
        ([{"role": "assistant", "content": "<answer>9</answer>"}], "9", 1.0),
    ],
)
def test_accuracy(completion, reference, expected):
    assert AccuracyReward()(completions=[completion], answer=[reference]) == [expected]


@pytest.mark.parametrize(
    "options, columns, expected",
    [
        ({}, {"answer": ["4"], "solution": ["5"]}, [1.0]),  # answer wins
        ({}, {"solution": ["\\boxed{4}"]}, [1.0]),  # TRL's math datasets
        ({"answer_column": "gold"}, {"gold": ["4"], "answer": ["5"]}, [1.0]),
        ({"rel_tol": 0.1}, {"answer": ["4.3"]}, [1.0]),
        ({"rel_tol": 0.0}, {"answer": ["4.0000001"]}, [0.0]),
    ],
)
def test_accuracy_columns_and_tolerance(options, columns, expected):
    assert (
        AccuracyReward(**options)(
            prompts=["q"], completions=["<answer>4</answer>"], completion_ids=[[1]], **columns
        )
        == expected
    )


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: AccuracyReward()(completions=["x"], other=["1"]),
            RewardError,
            "'answer' or 'solution' dataset column.*\\['other'\\]",
        ),
        (
            lambda: AccuracyReward(answer_column="gold")(completions=["x"], answer=["1"]),
            RewardError,
            "'gold' dataset column",
        ),
        (
            lambda: AccuracyReward()(completions=["x", "y"], answer=["1"]),
            RewardError,
            "1 reference answers for 2 completions",
        ),
        (
            lambda: AccuracyReward()(completions=["x"], answer=[["1"]]),
            RewardError,
            "reference answer must be a string or a number",
        ),
        (lambda: AccuracyReward(rel_tol=2), ConfigError, "rel_tol must be a number in \\[0, 1\\)"),
        (
            lambda: AccuracyReward()(completions=[5], answer=["1"]),
            RewardError,
            "completion must be a string or a list of chat messages, got int",
        ),
    ],
)
def test_accuracy_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>4</answer>", 1.0),
        ("  <answer>4</answer>\n", 1.0),
        ("<think>2+2</think><answer>4</answer>", 1.0),
        ("<think>\nmulti\nline\n</think>\n<answer>\n4\n</answer>", 1.0),
        ("<answer>4</answer> trailing", 0.0),
        ("leading <answer>4</answer>", 0.0),
        ("<answer>1</answer><answer>2</answer>", 0.0),
        ("<answer>4", 0.0),
        ("<think>x</think>", 0.0),
        ("<think>a</think><think>b</think><answer>4</answer>", 0.0),
        ("<answer>4</answer><think>late</think>", 0.0),
        ("", 0.0),
    ],
)
def test_format_default_pattern(text, expected):
    assert FormatReward()(completions=[text]) == [expected]


@pytest.mark.parametrize(
    "options, text, expected",
    [
        ({"pattern": r"^\d+$"}, "123", 1.0),
        ({"pattern": r"^\d+$"}, "12a", 0.0),
        ({"pattern": r"<answer>"}, "x <answer>", 1.0),  # searched, not anchored
        ({"pattern": r"^a.b$"}, "a\nb", 1.0),  # DOTALL
        ({"tags": ["think", "answer"]}, "<think>a</think><answer>b</answer>", 1.0),
        ({"tags": ["think", "answer"]}, "<answer>b</answer>", 0.0),
        ({"tags": ["think", "answer"], "partial": True}, "<answer>b</answer>", 0.5),
        ({"tags": ["think", "answer"], "partial": True}, "</think><think><answer>b</answer><answer>", 0.0),
        ({"tags": ["answer"]}, "</answer><answer>", 0.0),
        ({"tags": ["answer"]}, "<answer>1</answer><answer>2</answer>", 0.0),
    ],
)
def test_format_options(options, text, expected):
    assert FormatReward(**options)(completions=[text]) == [expected]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pattern": "x", "tags": ["a"]}, "either pattern or tags"),
        ({"pattern": "("}, "not a valid regular expression"),
        ({"tags": "answer"}, "tags must be a non-empty list"),
        ({"tags": []}, "tags must be a non-empty list"),
        ({"tags": ["<answer>"]}, "tags must be a non-empty list"),
        ({"partial": True}, "partial=True only applies to tags mode"),
    ],
)
def test_format_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        FormatReward(**options)


@pytest.mark.parametrize(
    "target, scale, length, expected",
    [
        (10, 1.0, 10, 0.0),
        (10, 1.0, 15, -0.5),
        (10, 1.0, 5, -0.5),
        (10, 2.0, 20, -2.0),
        (10, 0.0, 100, 0.0),
        (4, 1.0, 0, -1.0),
    ],
)
def test_length_penalty(target, scale, length, expected):
    fn = LengthPenalty(target=target, scale=scale)
    assert fn(completions=["x"], completion_ids=[[0] * length]) == [pytest.approx(expected)]


# DAPO: L_max = 20, buffer = 4 -> 0 up to 16 tokens, linear to -1 at 20, -1 beyond.
@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (10, 0.0),
        (16, 0.0),
        (17, -0.25),
        (18, -0.5),
        (19, -0.75),
        (20, -1.0),
        (21, -1.0),
        (500, -1.0),
    ],
)
def test_overlong_dapo_shaping(length, expected):
    fn = OverlongPenalty(max_completion_length=20, buffer=4)
    assert fn(completions=["x"], completion_ids=[[7] * length]) == [expected]


def test_overlong_buffer_equal_to_limit():
    fn = OverlongPenalty(max_completion_length=4, buffer=4)
    assert fn(completion_ids=[[], [1], [1, 2], [1, 2, 3, 4], [1] * 5]) == [0.0, -0.25, -0.5, -1.0, -1.0]


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: OverlongPenalty(max_completion_length=0, buffer=1),
            "max_completion_length must be a positive",
        ),
        (lambda: OverlongPenalty(max_completion_length=8, buffer=0), "buffer must be a positive"),
        (lambda: OverlongPenalty(max_completion_length=8, buffer=9), "buffer \\(9\\) must not exceed"),
        (
            lambda: OverlongPenalty(max_completion_length=8.5, buffer=2),
            "max_completion_length must be a positive",
        ),
        (lambda: LengthPenalty(target=0), "target must be a positive"),
        (lambda: LengthPenalty(target=5, scale=-1), "scale must be a non-negative"),
    ],
)
def test_length_config_errors(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


@pytest.mark.parametrize("fn", [LengthPenalty(target=3), OverlongPenalty(max_completion_length=3, buffer=1)])
def test_length_rewards_need_completion_ids(fn):
    with pytest.raises(RewardError, match="needs completion_ids"):
        fn(completions=["x"])
    with pytest.raises(RewardError, match="got 1 completion_ids for 2 completions"):
        fn(completions=["x", "y"], completion_ids=[[1]])


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("plain", "plain"),
        ([{"role": "assistant", "content": "hi"}], "hi"),
        (
            [
                {"role": "assistant", "content": "a"},
                {"role": "tool", "content": "T"},
                {"role": "assistant", "content": "b"},
            ],
            "ab",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "x"},
                        {"type": "image"},
                        {"type": "text", "text": "y"},
                    ],
                }
            ],
            "xy",
        ),
        ([{"content": "no role"}], "no role"),
        ({"role": "assistant", "content": "dict"}, "dict"),
        ([{"role": "assistant", "content": None}], ""),
    ],
)
def test_completion_text(completion, expected):
    assert completion_text(completion) == expected
