"""The built-in synthetic task: small arithmetic questions answered inside ``<answer>`` tags.

It is generated deterministically from a seed, needs no download, and has a checkable ``answer``
column, so recipes, tests and the tiny-model warm start can all use it offline.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo_ascend.vision.shapes_task import coloured_shapes_dataset

SYSTEM_PROMPT = "Solve the problem. Put only the final number inside <answer></answer>."
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticProblem:
    """One question, its integer answer and the reference completion used for the warm start."""

    question: str
    answer: int

    @property
    def completion(self) -> str:
        return f"<answer>{self.answer}</answer>"


def arithmetic_problems(
    n: int, seed: int = 0, max_operand: int = 10, ops: str = "+-"
) -> list[ArithmeticProblem]:
    """Return ``n`` problems ``a op b`` with operands in ``[0, max_operand)``, reproducible by ``seed``."""
    if n <= 0:
        raise ValueError(f"n must be a positive number of problems, got {n}")
    bad = [op for op in ops if op not in _OPS]
    if bad or not ops:
        raise ValueError(f"ops must be a non-empty string of {sorted(_OPS)}, got {ops!r}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        a, b = rng.randrange(max_operand), rng.randrange(max_operand)
        op = rng.choice(ops)
        problems.append(ArithmeticProblem(f"What is {a} {op} {b}?", _OPS[op](a, b)))
    return problems


def product_problems(n: int, seed: int = 0, digits: tuple[int, int] = (3, 2)) -> list[ArithmeticProblem]:
    """``n`` products ``a * b`` of a ``digits[0]``-digit and a ``digits[1]``-digit number (default
    3 × 2 digits: too hard for the tiny model in its head, easy with a calculator), reproducible by ``seed``."""
    if n <= 0:
        raise ValueError(f"n must be a positive number of problems, got {n}")
    if len(digits) != 2 or any(not isinstance(d, int) or d < 1 for d in digits):
        raise ValueError(f"digits must be two positive integers (digits of each factor), got {digits!r}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        a, b = (rng.randrange(10 ** (d - 1), 10**d) for d in digits)
        problems.append(ArithmeticProblem(f"What is {a} * {b}?", a * b))
    return problems


def conversation(question: str, system_prompt: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages for one question (TRL's conversational prompt format)."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return messages


def arithmetic_dataset(
    n: int = 1000,
    seed: int = 0,
    max_operand: int = 10,
    ops: str = "+-",
    system_prompt: str | None = SYSTEM_PROMPT,
) -> Any:
    """A ``datasets.Dataset`` with a conversational ``prompt`` column and a string ``answer`` column."""
    problems = arithmetic_problems(n, seed=seed, max_operand=max_operand, ops=ops)
    return _dataset(problems, system_prompt)


def products_dataset(
    n: int = 1000, seed: int = 0, digits: tuple[int, int] = (3, 2), system_prompt: str | None = SYSTEM_PROMPT
) -> Any:
    """Like :func:`arithmetic_dataset`, with :func:`product_problems` (the tool-calling demo's task)."""
    return _dataset(product_problems(n, seed=seed, digits=tuple(digits)), system_prompt)


def _dataset(problems: list[ArithmeticProblem], system_prompt: str | None) -> Any:
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [conversation(p.question, system_prompt) for p in problems],
            "answer": [str(p.answer) for p in problems],
        }
    )


#: ``synthetic:<name>`` datasets: name -> dataset builder (keyword arguments from ``dataset_kwargs``).
#: ``coloured_shapes`` is the vision-language task (:mod:`grpo_ascend.vision.shapes_task`: ``n``, ``seed``).
SYNTHETIC_TASKS: dict[str, Callable[..., Any]] = {"arithmetic": arithmetic_dataset, "products": products_dataset,
                                                  "coloured_shapes": coloured_shapes_dataset}
