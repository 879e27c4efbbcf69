"""Example custom reward functions in a user's own file (they work unchanged with TRL's GRPOTrainer).

Use them from a recipe, next to the built-ins::

    reward_funcs:
      - recipes/rewards/my_reward.py:my_reward
      - accuracy
    reward_weights: [0.5, 1.0]

(see recipes/custom_reward.yaml), with options written next to the name::

      - {name: recipes/rewards/my_reward.py:close_answer, decay_steps: 200}
      - {name: recipes/rewards/my_reward.py:brevity, max_tokens: 16}

or from Python: ``GRPOTrainer(..., reward_funcs=[my_reward, "accuracy"])``.

A reward function is called with keyword arguments: ``prompts``, ``completions`` (strings, or
lists of chat messages when the prompts are chat messages), ``completion_ids`` (token ids), every
other dataset column (one entry per completion, e.g. ``answer``) and ``trainer_state`` (``step``,
``epoch``; ``trainer_state.global_step`` works too). Name the ones you use, take the rest with
``**kwargs``, and return one float per completion, or None where the reward does not apply.
Options written next to ``name`` in the recipe are passed as keyword arguments.
"""

from __future__ import annotations

import re

_ANSWER_ONLY = re.compile(r"^\s*<answer>\s*-?\d+\s*</answer>\s*$")
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def _text(completion) -> str:
    """Plain-text datasets give strings; conversational ones give [{"role": "assistant", "content": ...}]."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def answer_only(completions, **kwargs) -> list[float]:
    """1.0 when the completion is exactly ``<answer>integer</answer>``, as the synthetic task asks."""
    return [1.0 if _ANSWER_ONLY.match(_text(c)) else 0.0 for c in completions]


def my_reward(completions, answer, **kwargs) -> list[float | None]:
    """Partial credit for near misses: ``1 / (1 + |predicted - answer|)``, so 1.0 when exact, 0.5
    when off by one, ... and 0.0 without an ``<answer>integer</answer>``. Rows whose reference is not
    an integer get None, so this reward is left out for them."""
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer):
        if reference is None or not re.fullmatch(r"-?\d+", str(reference).strip()):
            rewards.append(None)
            continue
        match = _ANSWER.search(_text(completion))
        if match is None:
            rewards.append(0.0)
            continue
        rewards.append(1.0 / (1.0 + abs(int(match.group(1)) - int(str(reference).strip()))))
    return rewards


def close_answer(completions, answer, trainer_state, decay_steps: int = 100, **kwargs) -> list[float | None]:
    """:func:`my_reward` fading linearly to 0 over the first ``decay_steps`` training steps (a
    curriculum: early on, being close is worth something; later only ``accuracy`` counts)."""
    fade = max(0.0, 1.0 - trainer_state.global_step / decay_steps)
    return [None if r is None else fade * r for r in my_reward(completions, answer)]


def brevity(completion_ids, max_tokens: int = 32, **kwargs) -> list[float]:
    """0 up to ``max_tokens`` tokens, then -0.01 per extra token (uses the token ids, not characters)."""
    return [-0.01 * max(0, len(ids) - max_tokens) for ids in completion_ids]
