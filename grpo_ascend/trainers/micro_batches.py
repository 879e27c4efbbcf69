"""Micro-batches of one optimizer step packed under a token budget (``max_tokens_per_micro_batch``).

The loss needs nothing from the split: every loss divides by totals of the whole optimizer step
(:class:`~grpo_ascend.algorithms.losses.LossNormaliser`), so the micro-batches may hold any rows,
in any number, and the step's gradient is still the one-batch gradient. Only the split changes.

What a micro-batch costs is what its log-prob forward runs through the decoder
(:class:`~grpo_ascend.models.policy.CompletionLogprobs`): every row's completion cut to the micro-batch's
longest (rounded up to the device's length bucket), plus the round's padded prompt width ``P`` --
once per group when a group's prompt runs once (``share_prompt_prefill``, no gradient
checkpointing), else once per row::

    tokens = rows × round_up(longest completion, bucket) + P × (groups if prompts are shared else rows)

Packing (:func:`pack_by_tokens`), deterministic and without any RNG: units are ordered longest
first (ties: their order in the step, i.e. the seeded shuffle) with their rows longest first, and
filled into micro-batches in that order, a unit starting a fresh micro-batch when it does not fit
the open one but fits whole; a unit that fits no micro-batch whole fills them row by row, and a
row over the budget on its own gets a micro-batch of its own (it is never dropped). When prompts
are shared two packings are made -- units = whole groups (each prompt runs once), and units =
single rows (less padding across groups, a group's prompt once per micro-batch it spans) -- and
the one whose micro-batches run fewer tokens in total is kept (whole groups on a tie).

Under data parallelism the ranks run the same number of micro-batches (an engine that reduces
gradients in every backward needs it; see docs/trainer.md): they agree on the largest count
and the others split micro-batches (:func:`split_to`), which never exceeds the budget. Every rank
holds the same number of rows per step, so the largest count is always reachable. Where every
rank's micro-batch ``k`` runs at the widest completion over all ranks (the strategy's ``fixed_calls``,
parameter-sharding engines), the ranks plan together instead (:func:`pack_in_lockstep`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_ascend.config.configs import BatchPlan
from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.errors import ConfigError

logger = logging.getLogger(__name__)


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

    def cost_with(self, cost: TokenCost, rows: list[int], groups: Sequence[int], longest: int) -> int:
        """The cost once ``rows`` (positions; ``groups`` maps them to their groups) are added."""
        count = len(self.groups | {groups[p] for p in rows})
        return cost(len(self.rows) + len(rows), count, max(self.longest, longest))

    def add(self, position: int, group: int, length: int) -> None:
        self.rows.append(position)
        self.groups.add(group)
        self.longest = max(self.longest, length)


def pack_by_tokens(lengths: Sequence[int], groups: Sequence[int], budget: int, cost: TokenCost) -> list[list[int]]:
    """Positions (0..n-1 into the step's rows) of each micro-batch; every position exactly once.

    ``lengths``: each row's completion length (up to its last token in the context); ``groups``:
    each row's prompt group (equal ids share a prompt). Of two packings (whole groups first, or
    rows by length alone) the one running fewer tokens is kept; see the module docstring.
    """
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        raise ConfigError(f"max_tokens_per_micro_batch must be a positive integer, got {budget!r}")
    if len(lengths) != len(groups):
        raise ValueError(f"{len(lengths)} lengths but {len(groups)} group ids")
    rows_alone = [[p] for p in range(len(lengths))]
    if not cost.share_prompts:
        return next_fit(rows_alone, lengths, groups, budget, cost)
    members: dict[int, list[int]] = {}
    for position, group in enumerate(groups):  # by first appearance in the step
        members.setdefault(group, []).append(position)
    candidates = [next_fit(list(members.values()), lengths, groups, budget, cost),
                  next_fit(rows_alone, lengths, groups, budget, cost)]

    def total(parts: list[list[int]]) -> tuple[int, int]:
        return sum(cost(len(p), len({groups[i] for i in p}), max(lengths[i] for i in p)) for p in parts), len(parts)

    best = min(candidates, key=total)  # the first (whole groups) on a tie
    return [_groups_adjacent(part, groups) for part in best]


def _groups_adjacent(part: list[int], groups: Sequence[int]) -> list[int]:
    """``part`` with each group's rows next to each other (the forward shares runs of equal prompts)."""
    first: dict[int, int] = {}
    for k, position in enumerate(part):
        first.setdefault(groups[position], k)
    return sorted(part, key=lambda position: first[groups[position]])


def next_fit(units: list[list[int]], lengths: Sequence[int], groups: Sequence[int], budget: int,
             cost: TokenCost) -> list[list[int]]:
    """A packing of ``units`` (lists of row positions) into micro-batches of at most ``budget`` tokens, one of
    the two :func:`pack_by_tokens` compares: units longest first, rows longest first, filled in that order; a
    unit that would not fit the open micro-batch but fits a fresh one starts a fresh one (it stays whole)."""
    units = [sorted(rows, key=lambda p: (-lengths[p], p)) for rows in units]
    units.sort(key=lambda rows: (-lengths[rows[0]], rows[0]))
    parts: list[list[int]] = []
    current = _Open([], set())

    def close() -> None:
        nonlocal current
        if current.rows:
            parts.append(current.rows)
        current = _Open([], set())

    for rows in units:
        longest, unit_groups = lengths[rows[0]], {groups[p] for p in rows}
        fresh = cost(len(rows), len(unit_groups), longest)
        if len(rows) > 1 and current.cost_with(cost, rows, groups, longest) > budget and fresh <= budget:
            close()  # the whole unit fits a fresh micro-batch: keep its prompt in one forward
        for position in rows:
            if current.rows and current.cost_with(cost, [position], groups, lengths[position]) > budget:
                close()
            current.add(position, groups[position], lengths[position])
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


def pack_in_lockstep(steps: Sequence[tuple[Sequence[int], Sequence[int], TokenCost]], budget: int) -> list[list[list[int]]]:
    """Every rank's micro-batches (as :func:`pack_by_tokens` returns) when micro-batch ``k`` of every
    rank runs at the widest completion over all ranks (``fixed_calls``). ``steps``: each rank's
    (lengths, groups, cost), the same number of rows on every rank; every rank computes the same plan.

    Each rank takes its rows longest first. Micro-batch ``k`` runs at the longest remaining row over
    all ranks; each rank fills it while its rows fit the budget at that width, keeping at least one
    row for each later micro-batch, and the last takes the rest. The count starts at the most any
    rank packs alone and grows until the last micro-batches fit too (at one row per micro-batch
    they always do).
    """
    orders = [sorted(range(len(lengths)), key=lambda p: (-lengths[p], p)) for lengths, _, _ in steps]
    rows = {len(order) for order in orders}
    if len(rows) != 1:
        raise ValueError(f"every rank must hold the same number of rows, got {sorted(rows)}")
    n = rows.pop()
    count = max((len(pack_by_tokens(lengths, groups, budget, cost)) for lengths, groups, cost in steps), default=0)
    while count < n:
        plan = _lockstep(steps, orders, budget, count)
        if plan is not None:
            return plan
        count += 1
    return [[[p] for p in order] for order in orders]


def _lockstep(steps: Sequence[tuple[Sequence[int], Sequence[int], TokenCost]], orders: list[list[int]], budget: int,
              count: int) -> list[list[list[int]]] | None:
    """The lockstep plan with exactly ``count`` micro-batches per rank, or None where the last one overflows."""
    n = len(orders[0])
    taken = [0] * len(steps)
    plan: list[list[list[int]]] = [[] for _ in steps]
    for k in range(count):
        longest = max(steps[r][0][orders[r][taken[r]]] for r in range(len(steps)))
        for r, (_, groups, cost) in enumerate(steps):
            order, start = orders[r], taken[r]
            most = n - start - (count - 1 - k)  # leave a row for each later micro-batch
            take, seen = 1, {groups[order[start]]}
            if k == count - 1:
                take, seen = most, {groups[p] for p in order[start : start + most]}
            while take < most and cost(take + 1, len(seen | {groups[order[start + take]]}), longest) <= budget:
                seen.add(groups[order[start + take]])
                take += 1
            part = order[start : start + take]
            if take > 1 and cost(take, len(seen), longest) > budget:
                return None
            plan[r].append(_groups_adjacent(part, groups) if cost.share_prompts else part)
            taken[r] += take
    return plan


def plan_for_rank(lengths: Tensor, groups: Tensor, cost: TokenCost, budget: int, ranks: Ranks,
                  widest_over_ranks: bool) -> tuple[list[list[int]], list[int]]:
    """This rank's micro-batches (positions into the step's rows), as many as every other rank's, and
    the rows' lengths on the host.

    ``lengths``, ``groups``: [rows] device tensors of the step's rows. Ranks that run each
    micro-batch at its own width pack alone and agree on the largest count (one max over ranks);
    ``widest_over_ranks`` (every rank's micro-batch ``k`` runs at the widest over all ranks) gathers
    every rank's rows and plans them together (:func:`pack_in_lockstep`). One host copy either way.
    """
    if not widest_over_ranks:
        host_lengths, host_groups = torch.stack([lengths, groups.to(lengths)]).tolist()
        parts = pack_by_tokens(host_lengths, host_groups, budget, cost)
        count = ranks.reduce(torch.tensor([float(len(parts))], device=lengths.device), "max")
        return split_to(parts, int(count[0]), host_groups), host_lengths
    n = lengths.shape[0]
    shape = torch.tensor([cost.prompt_width, cost.completion_width], device=lengths.device)
    everyone = ranks.gather(torch.cat([shape, lengths, groups.to(lengths)]).reshape(1, -1)).tolist()
    widest = max(row[1] for row in everyone)
    steps = [(row[2 : 2 + n], row[2 + n :], dataclasses.replace(cost, prompt_width=row[0], completion_width=widest))
             for row in everyone]
    return pack_in_lockstep(steps, budget)[ranks.rank], steps[ranks.rank][0]


class MicroBatcher:
    """Cuts each optimizer step's rows into micro-batches: ``micro_batch`` rows each, or packed under the
    token budget (``token_budget``: the plan's ``max_tokens_per_micro_batch``, 'auto' resolved at start-up).

    ``widest_over_ranks``: every rank's micro-batch ``k`` runs at the widest over ranks (the strategy's
    ``fixed_calls``); ``shares_prompts``: a group's prompt runs once per micro-batch in the log-prob forward.
    """

    def __init__(self, micro_batch: int, token_budget: int | None, ranks: Ranks, length_bucket: int,
                 shares_prompts: bool, widest_over_ranks: bool):
        self.micro_batch = micro_batch
        self.token_budget = token_budget
        self.ranks = ranks
        self.length_bucket = length_bucket
        self.shares_prompts = shares_prompts
        self.widest_over_ranks = widest_over_ranks
        self.warned_over_budget = False

    def split(self, rows: Tensor, completion_mask: Tensor, prompt_width: int, group_ids: Tensor) -> list[Tensor]:
        """The step's ``rows`` (indices into the round) as micro-batches; as many on every rank when packed.

        ``completion_mask``, ``group_ids``: the round's, indexed by ``rows``.
        """
        if self.token_budget is None:
            return list(rows.split(self.micro_batch))
        budget = self.token_budget
        mask = completion_mask[rows].ne(0)
        width = mask.shape[1]
        lengths = (mask * torch.arange(1, width + 1, device=mask.device)).amax(1) if width else mask.sum(1)
        cost = TokenCost(prompt_width=prompt_width, completion_width=width, share_prompts=self.shares_prompts,
                         length_bucket=self.length_bucket)
        parts, host_lengths = plan_for_rank(lengths, group_ids[rows], cost, budget, self.ranks, self.widest_over_ranks)
        over = [host_lengths[p[0]] for p in parts if len(p) == 1 and cost(1, 1, host_lengths[p[0]]) > budget]
        if over and not self.warned_over_budget:
            self.warned_over_budget = True
            logger.warning("max_tokens_per_micro_batch=%d is below what one row's forward costs (%d tokens: prompt width "
                           "%d + completion width %d); such rows get a micro-batch of their own (warned once)", budget,
                           cost(1, 1, over[0]), cost.prompt_width, cost.width(over[0]))
        order = torch.tensor([i for p in parts for i in p], device=rows.device)  # one copy to the device
        return list(rows[order].split([len(p) for p in parts]))


def round_row_order(n: int, plan: BatchPlan, seed: int, round_index: int, iteration: int,
                    device: torch.device) -> Tensor:
    """Row order for one pass over a round of ``n`` rows: seeded by (seed, round, iteration), so resume is exact.

    When every optimizer step holds whole groups (its rows are a multiple of G), whole groups are
    shuffled and a group's rows stay adjacent: the log-prob forward then runs each prompt once per
    micro-batch (``share_prompt_prefill``). Otherwise single rows are shuffled.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + round_index * 101 + iteration)
    G = plan.num_generations
    if (plan.micro_batch * plan.grad_accum) % G == 0 and n % G == 0:
        groups = torch.randperm(n // G, generator=gen)
        order = (groups[:, None] * G + torch.arange(G)).reshape(-1)
    else:
        order = torch.randperm(n, generator=gen)
    return order.to(device)
