"""Rollouts in lockstep with training (``rollout_mode: sync``): each round draws, samples and scores its
prompts while the trainer waits, with the trainer's current weights."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.data.prompts import PromptSampler
from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.experience import Experience, scored_experience
from grpo_ascend.rollout.protocol import Rollout
from grpo_ascend.tracking.phases import PhaseTimer


def draw_slice(sampler: PromptSampler, ranks: Ranks, prompts_per_rank: int) -> tuple[list[dict[str, Any]], Tensor]:
    """This rank's slice of the next ``prompts_per_rank × processes`` prompts and their global ids.

    Every rank draws the same global batch (the samplers stay in lockstep, so resume needs one
    state) and keeps its own slice: the ranks' prompts are disjoint, a group lives on one rank.
    """
    start = sampler.draws
    rows = sampler.next_rows(prompts_per_rank * ranks.world)
    first = ranks.rank * prompts_per_rank
    ids = torch.arange(start + first, start + first + prompts_per_rank)
    return rows[first : first + prompts_per_rank], ids


@dataclass(frozen=True)
class SourceParts:
    """What every experience source draws, samples and scores with: the prompt sampler (its one writer is the
    source), the run's rollout, the reward functions, the ranks, the sampling generator, and whether truncated
    completions leave the loss."""

    sampler: PromptSampler
    rollout: Rollout
    rewards: Any
    ranks: Ranks
    generator: torch.Generator
    mask_truncated_completions: bool = False

    def score(self, rows: list[dict[str, Any]], group_ids: Tensor, batch: Any, trainer_state: dict[str, Any],
              timer: PhaseTimer) -> Experience:
        """The scored :class:`Experience` of ``batch``, sampled for ``rows``."""
        return scored_experience(self.rewards, rows, group_ids, batch, trainer_state, timer,
                                 self.mask_truncated_completions)


class LockstepSource:
    """Draws, samples (inside ``rollout_context``: the trainer's current weights) and scores on demand."""

    def __init__(self, *, parts: SourceParts, rollout_context: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.parts = parts
        self.rollout_context = rollout_context

    def start(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        return None

    def next_scored(self, prompts_per_rank: int, timer: PhaseTimer,
                    trainer_state: Callable[[], dict[str, Any]]) -> Experience:
        parts = self.parts
        rows, group_ids = draw_slice(parts.sampler, parts.ranks, prompts_per_rank)
        with timer.phase("generation"), torch.no_grad(), self.rollout_context():
            batch = parts.rollout.generate_rows(rows, generator=parts.generator)
        return parts.score(rows, group_ids, batch, trainer_state(), timer)

    def policy_updated(self, step: int) -> None:
        return None  # the next round samples inside the trainer's rollout context, with the weights as they are

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any] | None:
        return None  # the sampler's state (saved by the checkpointer) says it all

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None
