"""Rule-based shaping rewards: output format, length penalty, DAPO's overlong shaping."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from grpo_ascend.errors import ConfigError, RewardError
from reward_models.text import completion_text

# Exactly one <answer>...</answer> block, optionally preceded by one <think>...</think> block,
# nothing else but whitespace around them. The tempered ``(?:(?!</?tag>).)*`` keeps a block from
# swallowing a second one, so ``<answer>1</answer><answer>2</answer>`` does not match.
DEFAULT_FORMAT_PATTERN = (
    r"^\s*(?:<think>(?:(?!</?think>).)*</think>\s*)?<answer>(?:(?!</?answer>).)*</answer>\s*$"
)


def _lengths(name: str, completion_ids: Sequence[Sequence[int]] | None, n: int) -> list[int]:
    if completion_ids is None:
        raise RewardError(f"{name} needs completion_ids (the completion token ids) to measure lengths")
    if len(completion_ids) != n:
        raise RewardError(f"{name}: got {len(completion_ids)} completion_ids for {n} completions")
    return [len(ids) for ids in completion_ids]


class FormatReward:
    """1.0 when a completion has the expected format, 0.0 otherwise.

    Two modes. ``pattern``: a regular expression searched in the completion text with ``re.DOTALL``
    (anchor it with ``^...$`` to constrain the whole text); the default requires exactly one
    ``<answer>...</answer>`` block, optionally after one ``<think>...</think>`` block, and nothing
    else. ``tags``: each listed tag must occur exactly once as ``<tag>`` followed later by
    ``</tag>``; with ``partial=True`` the reward is the fraction of tags that do.
    """

    def __init__(
        self, pattern: str | None = None, tags: Sequence[str] | None = None, partial: bool = False
    ) -> None:
        if pattern is not None and tags is not None:
            raise ConfigError("format: give either pattern or tags, not both")
        if partial and tags is None:
            raise ConfigError(
                "format: partial=True only applies to tags mode; set tags: [think, answer] or drop partial"
            )
        self.tags: list[str] | None = None
        self.pattern: re.Pattern[str] | None = None
        if tags is not None:
            if (
                isinstance(tags, str)
                or not tags
                or not all(isinstance(t, str) and re.fullmatch(r"[\w:.-]+", t) for t in tags)
            ):
                raise ConfigError(
                    f"format: tags must be a non-empty list of tag names like [think, answer], got {tags!r}"
                )
            self.tags = list(tags)
        else:
            source = DEFAULT_FORMAT_PATTERN if pattern is None else pattern
            if not isinstance(source, str):
                raise ConfigError(f"format: pattern must be a regular expression string, got {source!r}")
            try:
                self.pattern = re.compile(source, re.DOTALL)
            except re.error as exc:
                raise ConfigError(
                    f"format: pattern {source!r} is not a valid regular expression: {exc}"
                ) from None
        self.partial = bool(partial)
        self.__name__ = "format"

    def _tag_ok(self, text: str, tag: str) -> bool:
        opening, closing = f"<{tag}>", f"</{tag}>"
        if text.count(opening) != 1 or text.count(closing) != 1:
            return False
        return text.index(opening) < text.index(closing)

    def score(self, text: str) -> float:
        """The format reward of one completion text."""
        if self.pattern is not None:
            return 1.0 if self.pattern.search(text) else 0.0
        assert self.tags is not None
        hits = sum(self._tag_ok(text, tag) for tag in self.tags)
        if self.partial:
            return hits / len(self.tags)
        return 1.0 if hits == len(self.tags) else 0.0

    def __call__(
        self,
        prompts: list | None = None,
        completions: list | None = None,
        completion_ids: list | None = None,
        **kwargs: Any,
    ) -> list[float]:
        """Score each completion's format."""
        return [self.score(completion_text(c)) for c in completions or []]

    def __repr__(self) -> str:
        mode = (
            f"tags={self.tags!r}, partial={self.partial}"
            if self.tags
            else f"pattern={self.pattern.pattern!r}"
        )
        return f"FormatReward({mode})"


class LengthPenalty:
    """``-scale * |n - target| / target`` for a completion of ``n`` tokens: 0 at the target length,
    growing linearly (relative to the target) as the completion gets longer or shorter."""

    def __init__(self, target: int, scale: float = 1.0) -> None:
        if isinstance(target, bool) or not isinstance(target, int) or target <= 0:
            raise ConfigError(f"length_penalty: target must be a positive number of tokens, got {target!r}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
            raise ConfigError(f"length_penalty: scale must be a non-negative number, got {scale!r}")
        self.target = target
        self.scale = float(scale)
        self.__name__ = "length_penalty"

    def __call__(
        self,
        prompts: list | None = None,
        completions: list | None = None,
        completion_ids: list | None = None,
        **kwargs: Any,
    ) -> list[float]:
        """Penalise each completion by its token-length distance to the target."""
        n = len(completions) if completions is not None else len(completion_ids or [])
        return [
            -self.scale * abs(length - self.target) / self.target
            for length in _lengths("length_penalty", completion_ids, n)
        ]

    def __repr__(self) -> str:
        return f"LengthPenalty(target={self.target}, scale={self.scale})"


class OverlongPenalty:
    """DAPO's soft overlong punishment on token lengths.

    With ``L = max_completion_length`` and ``B = buffer``: 0 for a completion of ``n <= L - B``
    tokens, ``(L - B - n) / B`` for ``L - B < n <= L`` (linear from 0 down to -1 at ``L``), and -1
    beyond ``L``. Add it to a correctness reward so truncated rambling is discouraged gradually
    instead of by a cliff.
    """

    def __init__(self, max_completion_length: int, buffer: int) -> None:
        for key, value in (("max_completion_length", max_completion_length), ("buffer", buffer)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"overlong: {key} must be a positive number of tokens, got {value!r}")
        if buffer > max_completion_length:
            raise ConfigError(
                f"overlong: buffer ({buffer}) must not exceed max_completion_length ({max_completion_length})"
            )
        self.max_completion_length = max_completion_length
        self.buffer = buffer
        self.__name__ = "overlong"

    def penalty(self, length: int) -> float:
        """The penalty for one completion of ``length`` tokens."""
        start = self.max_completion_length - self.buffer
        if length <= start:
            return 0.0
        if length <= self.max_completion_length:
            return (start - length) / self.buffer
        return -1.0

    def __call__(
        self,
        prompts: list | None = None,
        completions: list | None = None,
        completion_ids: list | None = None,
        **kwargs: Any,
    ) -> list[float]:
        """Penalise each completion that runs into the last ``buffer`` tokens before the limit."""
        n = len(completions) if completions is not None else len(completion_ids or [])
        return [self.penalty(length) for length in _lengths("overlong", completion_ids, n)]

    def __repr__(self) -> str:
        return f"OverlongPenalty(max_completion_length={self.max_completion_length}, buffer={self.buffer})"
