"""The batch arithmetic of a run (:class:`BatchPlan`), made by :meth:`BaseRLConfig.batch_plan`: completions and
prompts per generation round, per optimizer step and per process, and how steps line up with generation batches."""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_ascend.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic for one run, spelled out (TRL's is a frequent source of confusion).

    The run's one home of ``num_generations`` (G) and ``max_tokens_per_micro_batch``: the trainer and its
    parts read them here, checked once when the plan is made.
    """

    world_size: int
    num_generations: int
    micro_batch: int
    grad_accum: int
    steps_per_generation: int
    num_iterations: int
    #: Token budget that packs each step's rows into micro-batches (None: grad_accum of micro_batch rows;
    #: 'auto': chosen from the device's memory when the trainer starts).
    max_tokens_per_micro_batch: int | str | None = None

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError(
                f"num_generations must be >= 2 (group-relative advantages need a group), got {self.num_generations}"
            )
        per_device = self.micro_batch * self.steps_per_generation
        if per_device % self.num_generations:
            raise ConfigError(
                f"completions per generation round on each device ({per_device} = per_device_train_batch_size "
                f"{self.micro_batch} × steps_per_generation {self.steps_per_generation}) must be divisible by "
                f"num_generations ({self.num_generations}) so every group stays on one device; change one of them"
            )

    @property
    def completions_per_generation(self) -> int:
        return self.micro_batch * self.steps_per_generation * self.world_size

    @property
    def prompts_per_generation(self) -> int:
        return self.completions_per_generation // self.num_generations

    @property
    def prompts_per_rank(self) -> int:
        """Prompts of one generation round on each process (its slice of the global draw)."""
        return self.prompts_per_generation // self.world_size

    @property
    def completions_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Whole optimizer steps one generation batch feeds (when steps do not straddle batches)."""
        return self.steps_per_generation // self.grad_accum * self.num_iterations

    @property
    def generations_per_round(self) -> int:
        """Generation batches in one training round: 1, unless steps_per_generation × num_iterations
        micro-batches are not a multiple of grad_accum. Then, as in TRL, an optimizer step may take its
        micro-batches from two generation batches, and a round runs until the steps line up again."""
        per_generation = self.steps_per_generation * self.num_iterations
        return self.grad_accum // math.gcd(per_generation, self.grad_accum)

    @property
    def optimizer_steps_per_round(self) -> int:
        return self.steps_per_generation * self.num_iterations * self.generations_per_round // self.grad_accum

    @property
    def prompts_per_round(self) -> int:
        return self.prompts_per_generation * self.generations_per_round

    def old_logps_needed(self, generation: int) -> bool:
        """Whether generation batch ``generation`` of a round is still trained on after an optimizer step
        (then the ratio needs the sampling policy's log-probs; TRL's rule for the aligned case too)."""
        per_generation = self.steps_per_generation * self.num_iterations
        return generation * per_generation % self.grad_accum + per_generation > self.grad_accum

    def describe(self) -> str:
        return (
            f"batch plan: {self.prompts_per_generation} prompts × {self.num_generations} generations = "
            f"{self.completions_per_generation} completions per generation round; "
            f"{self.completions_per_step} completions per optimizer step "
            + (f"({self.grad_accum} micro-batches of {self.micro_batch} × {self.world_size} process(es)); "
               if self.max_tokens_per_micro_batch is None else
               f"({self.micro_batch * self.grad_accum} × {self.world_size} process(es), in micro-batches of at most "
               f"{self.max_tokens_per_micro_batch} tokens); " if self.max_tokens_per_micro_batch != "auto" else
               f"({self.micro_batch * self.grad_accum} × {self.world_size} process(es), in micro-batches under a token "
               "budget chosen from the device's memory at start-up); ")
            + (f"{self.optimizer_steps_per_generation} optimizer step(s) per generation round"
               if self.generations_per_round == 1 else
               f"optimizer steps straddle generation rounds: {self.generations_per_round} rounds feed "
               f"{self.optimizer_steps_per_round} optimizer step(s)")
            + (f" ({self.num_iterations} iterations)" if self.num_iterations > 1 else "")
        )

