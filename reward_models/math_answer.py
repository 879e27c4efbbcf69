"""Math answer accuracy: extract the final answer from a completion and compare it to the reference.

Plain numbers (GSM8K, ``3/4``, ``\\frac{3}{4}``, ``1,000``) are compared exactly here with regular
expressions and ``fractions.Fraction``. Other answers (LaTeX expressions, sets, intervals, units,
percentages) go to Math-Verify when it is installed (``reward_models.math_verify_check``: LaTeX
parsing only, a timeout per check), else are compared as normalised strings. Nothing is ever
evaluated as code, so a completion such as ``<answer>__import__('os')</answer>`` is just a string.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from grpo_ascend.errors import ConfigError, RewardError
from reward_models.math_verify_check import (
    INSTALL_HINT,
    MathVerifyChecker,
    math_verify_available,
    require_math_verify,
)
from reward_models.text import completion_text

logger = logging.getLogger(__name__)

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_GSM8K = re.compile(r"####[ \t]*([^\n]*)")

# A plain decimal number: 3, -3, 3.5, .5, 5., 1e3 (exponent capped at 3 digits: no huge powers).
_DECIMAL = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?"
_DECIMAL_RE = re.compile(_DECIMAL)
# Comma thousands separators: 1,000 or 1,234,567.89 (groups of exactly three digits).
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SLASH_FRACTION_RE = re.compile(rf"({_DECIMAL})\s*/\s*({_DECIMAL})")
_LATEX_FRACTION_RE = re.compile(rf"([+-]?)\\[dt]?frac\s*\{{\s*({_DECIMAL})\s*\}}\s*\{{\s*({_DECIMAL})\s*\}}")
_LATEX_SHORT_FRACTION_RE = re.compile(r"([+-]?)\\[dt]?frac(\d)(\d)")
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_MAX_NUMBER_CHARS = 64


def _last_braced(text: str, start: int) -> str | None:
    """Content of the balanced ``{...}`` group opening at or after ``start`` (whitespace skipped)."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        # ``\boxed 5``: the argument is the next whitespace-free token.
        match = re.match(r"[^\s$}]+", text[i:])
        return match.group(0) if match else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    for match in reversed(list(_BOXED.finditer(text))):
        content = _last_braced(text, match.end())
        if content is not None:
            return content.strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in a completion, or None when it gives none.

    Looks, in this order, for the last ``<answer>...</answer>`` block (a ``\\boxed{}`` inside it is
    unwrapped), the last ``\\boxed{...}``, then the last GSM8K-style ``#### value`` line.
    """
    tags = _ANSWER_TAG.findall(text)
    if tags:
        inner = tags[-1]
        return (extract_boxed(inner) or inner).strip()
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    gsm = _GSM8K.findall(text)
    if gsm:
        return gsm[-1].strip()
    return None


def _normalize(text: str) -> str:
    """Strip formatting that does not change a value: ``$``, ``\\text{}``, spacing commands, ``%``, units of degrees."""
    s = text.strip()
    s = _TEXT_WRAPPER_RE.sub(r"\1", s)
    for token in (
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "\\ ",
        "\\$",
        "$",
        "\\%",
        "%",
        "^\\circ",
        "^{\\circ}",
        "°",
    ):
        s = s.replace(token, "")
    s = s.replace("{,}", ",")
    s = s.strip().rstrip(".").strip()
    return re.sub(r"^([+-])\s+", r"\1", s)


def _decimal(text: str) -> Fraction | None:
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    if not _DECIMAL_RE.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _parse_exact(text: str) -> Fraction | None:
    """The exact value of a written number (see :func:`parse_number`), or None."""
    s = _normalize(text)
    if not s or len(s) > _MAX_NUMBER_CHARS:
        return None
    value = _decimal(s)
    if value is None:
        match = _LATEX_FRACTION_RE.fullmatch(s) or _LATEX_SHORT_FRACTION_RE.fullmatch(s)
        if match:
            sign, num, den = match.groups()
        else:
            match = _SLASH_FRACTION_RE.fullmatch(s)
            if not match:
                return None
            sign, (num, den) = "", match.groups()
        n, d = _decimal(num), _decimal(den)
        if n is None or d is None or d == 0:
            return None
        value = -n / d if sign == "-" else n / d
    try:
        return value if math.isfinite(float(value)) else None
    except OverflowError:
        return None


def parse_number(text: str) -> float | None:
    """Parse a written number into a float, or None when ``text`` is not one number.

    Accepts ``42``, ``-3``, ``+3``, ``1000.0``, ``.5``, ``1e3``, ``1,000`` (groups of three),
    ``$1,000``, ``3/4``, ``\\frac{3}{4}``, ``-\\frac34``, ``\\dfrac{3}{4}``, ``50%`` (read as 50: the
    percent sign is dropped, not divided by 100), surrounding ``$...$`` and ``\\text{}``. Rejects
    anything else, including expressions (``2+3``), words, ``1,5`` and non-finite values.
    """
    value = _parse_exact(text)
    return None if value is None else float(value)


def _plain_number(text: str) -> Fraction | None:
    """The exact value when ``text`` is a plain number (the fast path); percentages are left to
    Math-Verify, which reads ``50\\%`` as both 50 and 0.5."""
    return None if "%" in text else _parse_exact(text)


def _numbers_equal(p: Fraction, r: Fraction, rel_tol: float) -> bool:
    if p.denominator == 1 and r.denominator == 1:
        return p == r
    return math.isclose(float(p), float(r), rel_tol=rel_tol, abs_tol=0.0)


def answers_match(
    predicted: str, reference: str, rel_tol: float = 1e-6, checker: MathVerifyChecker | None = None
) -> bool:
    """True when two answers agree.

    Two plain numbers are compared here: two integers (``1000``, ``1,000.0``) must be equal exactly,
    other numbers must agree within ``rel_tol`` (so ``0.333333333`` matches ``1/3``). Anything else
    goes to ``checker`` (Math-Verify) when given: equal if it says so, or if the two are equal as
    strings after normalisation (whitespace removed); a check that timed out or failed falls back to
    that string comparison. Without a checker, a number never equals a non-number.
    """
    p, r = _plain_number(predicted), _plain_number(reference)
    if p is not None and r is not None:
        return _numbers_equal(p, r, rel_tol)
    norm_p = re.sub(r"\s+", "", _normalize(predicted))
    norm_r = re.sub(r"\s+", "", _normalize(reference))
    same_text = bool(norm_r) and norm_p == norm_r
    if checker is not None:
        return bool(checker.equivalent(predicted, reference)) or same_text
    p, r = _parse_exact(predicted), _parse_exact(reference)
    if p is not None and r is not None:
        return _numbers_equal(p, r, rel_tol)
    if p is not None or r is not None:
        return False
    return same_text


def reference_answer(value: Any) -> str | None:
    """The reference answer from a dataset cell: a GSM8K solution (``#### n``), a LaTeX solution
    with ``\\boxed{}``, an ``<answer>`` block, or a bare value (numbers converted with ``str``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RewardError(
            f"the reference answer must be a string or a number, got {type(value).__name__}: {value!r}"
        )
    text = str(value).strip()
    if not text:
        return None
    extracted = extract_answer(text)
    return extracted if extracted is not None else text


class AccuracyReward:
    """1.0 when the completion's final answer equals the reference answer, 0.0 otherwise.

    ``math_verify``: "auto" (default) checks non-numeric answers with Math-Verify when it is
    installed; true requires it (ConfigError naming the extra if missing); false never uses it.
    ``math_verify_timeout``: seconds per Math-Verify check (one that runs over scores 0.0).

    The reference comes from the ``answer_column`` dataset column; by default ``answer`` (this
    project's synthetic task, GSM8K) or, failing that, ``solution`` (TRL's math datasets). A
    completion with no extractable answer scores 0.0; a missing or empty reference gives None
    ("not applicable"), so that completion is left out of this function's contribution.
    """

    def __init__(
        self,
        answer_column: str | None = None,
        rel_tol: float = 1e-6,
        math_verify: bool | str = "auto",
        math_verify_timeout: float = 5.0,
    ) -> None:
        if answer_column is not None and not isinstance(answer_column, str):
            raise ConfigError(f"accuracy: answer_column must be a column name, got {answer_column!r}")
        if not isinstance(rel_tol, (int, float)) or not 0 <= rel_tol < 1:
            raise ConfigError(f"accuracy: rel_tol must be a number in [0, 1), got {rel_tol!r}")
        if math_verify not in (True, False, "auto"):
            raise ConfigError(f"accuracy: math_verify must be true, false or 'auto', got {math_verify!r}")
        if math_verify is True:
            require_math_verify("accuracy")
        self.answer_column = answer_column
        self.rel_tol = float(rel_tol)
        self.math_verify = math_verify
        self.checker: MathVerifyChecker | None = None
        if math_verify is True or (math_verify == "auto" and math_verify_available()):
            self.checker = MathVerifyChecker(timeout=math_verify_timeout)
        elif math_verify == "auto":
            logger.warning(
                "accuracy: math-verify is not installed, so LaTeX and symbolic answers are compared as "
                "normalised strings (plain numbers are unaffected); for equivalence checking: %s", INSTALL_HINT
            )
        self.__name__ = "accuracy"

    def _references(self, kwargs: dict[str, Any]) -> Sequence[Any]:
        candidates = [self.answer_column] if self.answer_column else ["answer", "solution"]
        for column in candidates:
            if column in kwargs:
                return kwargs[column]
        columns = sorted(k for k in kwargs if k != "trainer_state")
        wanted = " or ".join(repr(c) for c in candidates)
        raise RewardError(
            f"accuracy needs the reference answers in a {wanted} dataset column, but the batch has "
            f"columns {columns}; add the column or set answer_column (e.g. {{name: accuracy, answer_column: ...}})"
        )

    def __call__(
        self,
        prompts: list | None = None,
        completions: list | None = None,
        completion_ids: list | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        """Score each completion against the reference in the same position."""
        completions = completions or []
        references = self._references(kwargs)
        if len(references) != len(completions):
            raise RewardError(
                f"accuracy: got {len(references)} reference answers for {len(completions)} completions; "
                "the column must hold one entry per completion"
            )
        rewards: list[float | None] = []
        for completion, raw in zip(completions, references):
            reference = reference_answer(raw)
            if reference is None:
                rewards.append(None)
                continue
            predicted = extract_answer(completion_text(completion))
            ok = predicted is not None and answers_match(predicted, reference, self.rel_tol, self.checker)
            rewards.append(1.0 if ok else 0.0)
        return rewards

    def __repr__(self) -> str:
        return (
            f"AccuracyReward(answer_column={self.answer_column!r}, rel_tol={self.rel_tol}, "
            f"math_verify={self.checker is not None})"
        )
