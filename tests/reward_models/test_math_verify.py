"""The accuracy reward backed by Math-Verify: tricky LaTeX/symbolic answers, the exact-number fast
path, a timeout per check, no code evaluation, and a clear fallback when the package is missing."""

from __future__ import annotations

import logging
import threading

import pytest

import reward_models.math_answer as math_answer
import reward_models.math_verify_check as mvc
from grpo_ascend.errors import ConfigError
from reward_models.math_answer import AccuracyReward, answers_match

pytestmark = pytest.mark.skipif(not mvc.math_verify_available(), reason="needs math-verify (extra: math)")


@pytest.fixture(scope="module")
def accuracy():
    reward = AccuracyReward(math_verify=True, math_verify_timeout=20.0)
    yield reward
    reward.checker.close()


CASES = [
    # (completion, reference answer, expected reward)
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),  # fraction vs decimal
    ("<answer>\\dfrac{3}{4}</answer>", "0.75", 1.0),
    ("$\\boxed{\\frac{\\sqrt{2}}{2}}$", "\\frac{1}{\\sqrt{2}}", 1.0),  # symbolic, different forms
    ("$\\boxed{(x+1)^2}$", "x^2+2x+1", 1.0),
    ("$\\boxed{\\{1, 2\\}}$", "\\{2,1\\}", 1.0),  # sets: order does not matter
    ("$\\boxed{\\{1, 3\\}}$", "\\{2,1\\}", 0.0),
    ("$\\boxed{(0, 1]}$", "(0,1]", 1.0),  # intervals: open/closed ends matter
    ("$\\boxed{[0, 1]}$", "(0,1]", 0.0),
    ("$\\boxed{5\\text{ cm}}$", "5", 1.0),  # units
    ("$\\boxed{50\\%}$", "50", 1.0),  # percent
    ("$\\boxed{50\\%}$", "0.5", 1.0),
    ("$\\boxed{\\pi}$", "3.14159", 0.0),  # no approximate match of a symbol
    ("$\\boxed{0.3333}$", "\\frac{1}{3}", 0.0),
    ("Final: \\boxed{\\frac{2}{3}} and more text", "\\boxed{\\frac{4}{6}}", 1.0),  # boxed reference too
    ("#### 1,000", "#### 1000", 1.0),  # GSM8K: fast path
    ("#### 72", "#### 27", 0.0),
]


@pytest.mark.parametrize(("completion", "reference", "expected"), CASES)
def test_tricky_answers(accuracy, completion, reference, expected):
    assert accuracy(completions=[completion], answer=[reference]) == [expected]


def test_plain_numbers_never_start_the_worker():
    reward = AccuracyReward(math_verify=True)
    scores = reward(completions=["#### 42", "<answer>3/4</answer>", "\\boxed{-7}", "#### 1,000.0"],
                    answer=["42", "0.75", "-7", "1000"])
    assert scores == [1.0, 1.0, 1.0, 1.0]
    assert reward.checker.worker_process is None


def test_code_is_never_evaluated(accuracy, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    assert accuracy(completions=[f"<answer>{payload}</answer>"], answer=["0"]) == [0.0]
    assert accuracy(completions=[f"$\\boxed{{{payload}}}$"], answer=[payload]) == [1.0]  # equal as text only
    assert not marker.exists()


def test_works_from_a_worker_thread(accuracy):
    """Math-Verify's own timeouts need the main thread; ours do not (reward_timeout runs rewards in threads)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(accuracy(completions=["$\\boxed{\\{2,1\\}}$"],
                                                                 answer=["\\{1,2\\}"])))
    thread.start()
    thread.join(60)
    assert out == [[1.0]]


def test_timeout_kills_the_check_and_recovers(tmp_path):
    slow = tmp_path / "slow_worker.py"
    slow.write_text(
        "import sys, time, json\nprint(json.dumps({'ready': True}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    req = json.loads(line)\n"
        "    if req['predicted'] == 'slow':\n        time.sleep(60)\n"
        "    print(json.dumps({'equal': req['predicted'] == req['reference']}), flush=True)\n"
    )
    checker = mvc.MathVerifyChecker(timeout=0.5, worker_script=slow)
    assert checker.equivalent("a", "a") is True
    first = checker.worker_process
    assert checker.equivalent("slow", "x") is None
    assert checker.timeouts == 1 and first.poll() is not None  # killed
    assert checker.equivalent("b", "b") is True  # a fresh worker
    checker.close()
    # Through answers_match a timed-out check counts as "not equal" unless the texts are equal.
    checker = mvc.MathVerifyChecker(timeout=0.5, worker_script=slow)
    assert answers_match("slow", "x^2", checker=checker) is False
    checker.close()


def test_missing_package_is_a_clear_error_or_a_fallback(monkeypatch, caplog):
    monkeypatch.setattr(mvc, "math_verify_available", lambda: False)
    monkeypatch.setattr(math_answer, "math_verify_available", lambda: False)
    with pytest.raises(ConfigError, match=r"math_verify=true needs the math-verify package: pip install 'grpo-ascend\[math\]'"):
        AccuracyReward(math_verify=True)
    with caplog.at_level(logging.WARNING):
        reward = AccuracyReward()
    assert reward.checker is None and "grpo-ascend[math]" in caplog.text
    # Plain numbers and LaTeX fractions still compare exactly; sets fall back to string equality.
    assert reward(completions=["\\boxed{\\frac{1}{2}}", "\\boxed{\\{2,1\\}}", "\\boxed{\\{1,2\\}}"],
                  answer=["0.5", "\\{1,2\\}", "\\{1,2\\}"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ConfigError, match="math_verify must be true, false or 'auto'"):
        AccuracyReward(math_verify="yes")
    with pytest.raises(ConfigError, match="timeout must be a positive number"):
        mvc.MathVerifyChecker(timeout=0)

