"""Rollouts in lockstep with training (``rollout_mode: sync``): each round draws, samples and scores its
prompts while the trainer waits, with the trainer's current weights."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
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


class LockstepSource:
    """Draws, samples (inside ``rollout_context``: the trainer's current weights) and scores on demand."""

    def __init__(
        self,
        *,
        sampler: PromptSampler,
        rollout: Rollout,
        rewards: Any,
        ranks: Ranks,
        generator: torch.Generator,
        rollout_context: Callable[[], contextlib.AbstractContextManager],
        mask_truncated_completions: bool = False,
    ) -> None:
        self.sampler = sampler
        self.rollout = rollout
        self.rewards = rewards
        self.ranks = ranks
        self.generator = generator
        self.rollout_context = rollout_context
        self.mask_truncated_completions = mask_truncated_completions

    def start(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        return None

    def next_scored(self, prompts_per_rank: int, timer: PhaseTimer,
                    trainer_state: Callable[[], dict[str, Any]]) -> Experience:
        rows, group_ids = draw_slice(self.sampler, self.ranks, prompts_per_rank)
        with timer.phase("generation"), torch.no_grad(), self.rollout_context():
            batch = self.rollout.generate_rows(rows, generator=self.generator)
        return scored_experience(self.rewards, rows, group_ids, batch, trainer_state(), timer,
                                 self.mask_truncated_completions)

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
