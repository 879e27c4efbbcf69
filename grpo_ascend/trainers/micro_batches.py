"""Micro-batches of one optimizer step packed under a token budget (``max_tokens_per_micro_batch``).

The loss needs nothing from the split: every loss divides by totals of the whole optimizer step
(:class:`~grpo_ascend.algorithms.losses.LossNormaliser`), so the micro-batches may hold any rows,
in any number, and the step's gradient is still the one-batch gradient. Only the split changes.

What a micro-batch costs is what its log-prob forward runs through the decoder
(:class:`~grpo_ascend.models.CompletionLogprobs`): every row's completion cut to the micro-batch's
longest (rounded up to the device's length bucket), plus the round's padded prompt width ``P`` --
once per group when a group's prompt runs once (``share_prompt_prefill``, no gradient
checkpointing), else once per row::

    tokens = rows × round_up(longest completion, bucket) + P × (groups if prompts are shared else rows)

Packing (:func:`pack_by_tokens`), deterministic and without any RNG: a step's rows are grouped
by prompt (when prompts are shared, so a group's prompt runs once), groups are ordered longest
first (ties: their order in the step, i.e. the seeded shuffle) with their rows longest first, and
filled into micro-batches in that order while the next whole group still fits; a group that fits
no micro-batch whole fills them row by row; a row over the budget on its own gets a micro-batch of
its own (it is never dropped).

Under data parallelism every rank must run the same number of forwards and backwards (DDP's
forward broadcasts buffers, and the gradient all-reduce waits for every rank), so the ranks agree
on the largest count and the others split micro-batches (:func:`split_to`), which never exceeds the
budget. Every rank holds the same number of rows per step, so the largest count is always reachable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grpo_ascend.errors import ConfigError


@dataclass(frozen=True)
class TokenCost:
    """The decoder tokens of a micro-batch's log-prob forward (see the module docstring)."""

    prompt_width: int
    completion_width: int
    share_prompts: bool
    length_bucket: int = 1

    def width(self, longest: int) -> int:
        """Columns the forward keeps for a micro-batch whose longest completion is ``longest``."""
        needed = max(longest, 1)
        bucket = max(self.length_bucket, 1)
        return min(self.completion_width, -(-needed // bucket) * bucket)

    def __call__(self, rows: int, groups: int, longest: int) -> int:
        prompts = groups if self.share_prompts else rows
        return rows * self.width(longest) + prompts * self.prompt_width


@dataclass
class _Open:
    """The micro-batch being filled: its rows (step positions), groups and longest completion."""

    rows: list[int]
    groups: set[int]
    longest: int = 0

    def cost_with(self, cost: TokenCost, rows: int, group: int, longest: int) -> int:
        groups = len(self.groups) + (group not in self.groups)
        return cost(len(self.rows) + rows, groups, max(self.longest, longest))

    def add(self, position: int, group: int, length: int) -> None:
        self.rows.append(position)
        self.groups.add(group)
        self.longest = max(self.longest, length)


def pack_by_tokens(lengths: Sequence[int], groups: Sequence[int], budget: int, cost: TokenCost) -> list[list[int]]:
    """Positions (0..n-1 into the step's rows) of each micro-batch; every position exactly once.

    ``lengths``: each row's completion length (up to its last token in the context); ``groups``:
    each row's prompt group (equal ids share a prompt). See the module docstring for the order.
    """
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ConfigError(f"max_tokens_per_micro_batch must be a positive integer, got {budget!r}")
    if len(lengths) != len(groups):
        raise ValueError(f"{len(lengths)} lengths but {len(groups)} group ids")
    members: dict[int, list[int]] = {}
    for position, group in enumerate(groups):  # by first appearance in the step
        members.setdefault(group if cost.share_prompts else -1 - position, []).append(position)
    units = [sorted(rows, key=lambda p: (-lengths[p], p)) for rows in members.values()]
    units.sort(key=lambda rows: (-lengths[rows[0]], rows[0]))

    parts: list[list[int]] = []
    current = _Open([], set())

    def close() -> None:
        nonlocal current
        if current.rows:
            parts.append(current.rows)
        current = _Open([], set())

    for rows in units:
        group, longest = groups[rows[0]], lengths[rows[0]]
        if current.cost_with(cost, len(rows), group, longest) > budget and cost(len(rows), 1, longest) <= budget:
            close()  # the whole group fits a fresh micro-batch: keep its prompt in one forward
        for position in rows:
            if current.rows and current.cost_with(cost, 1, group, lengths[position]) > budget:
                close()
            current.add(position, group, lengths[position])
    close()
    return parts


def split_to(parts: list[list[int]], count: int, groups: Sequence[int]) -> list[list[int]]:
    """``parts`` split until there are ``count`` of them: the one with the most rows (the first of
    equals) is halved, at the group boundary nearest its middle when it holds more than one group.

    A part of a packing only loses rows, so each still fits the budget it was packed under.
    """
    rows = sum(len(p) for p in parts)
    if count > rows:
        raise ValueError(f"cannot split {rows} rows into {count} micro-batches")
    parts = [list(p) for p in parts]
    while len(parts) < count:
        i = max(range(len(parts)), key=lambda k: (len(parts[k]), -k))
        part = parts[i]
        cuts = [k for k in range(1, len(part)) if groups[part[k]] != groups[part[k - 1]]]
        middle = len(part) / 2
        cut = min(cuts, key=lambda k: (abs(k - middle), k)) if cuts else len(part) // 2
        parts[i : i + 1] = [part[:cut], part[cut:]]
    return parts
