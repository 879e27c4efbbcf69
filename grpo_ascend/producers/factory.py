"""The experience source a ``rollout_mode`` names, from a registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_ascend.config.configs import BaseRLConfig, BatchPlan
from grpo_ascend.errors import ConfigError
from grpo_ascend.experience import ExperienceSource
from grpo_ascend.producers.asynchronous import AsyncSettings, AsyncSource
from grpo_ascend.producers.lockstep import LockstepSource, SourceParts


def _lockstep(args: BaseRLConfig, plan: BatchPlan, push: Callable[[int], None], parts: SourceParts,
              rollout_context: Any) -> ExperienceSource:
    return LockstepSource(parts=parts, rollout_context=rollout_context)


def _ahead(args: BaseRLConfig, plan: BatchPlan, push: Callable[[int], None], parts: SourceParts,
           rollout_context: Any) -> ExperienceSource:
    """A producer ahead of training; it samples outside the trainer's ``rollout_context``, on a sampler of its own."""
    if plan.generations_per_round != 1:
        raise ConfigError(f"rollout_mode={args.rollout_mode!r} needs whole optimizer steps per generation batch; "
                          f"{plan.describe()}. Make steps_per_generation × num_iterations a multiple of "
                          "gradient_accumulation_steps")
    if args.rollout_mode == "one_step_off":
        inflight = plan.prompts_per_rank
    elif args.max_inflight_tasks == -1:
        inflight = max(args.max_staleness, 1) * plan.prompts_per_rank
    else:
        inflight = args.max_inflight_tasks
    if inflight < plan.prompts_per_rank:
        raise ConfigError(f"max_inflight_tasks={args.max_inflight_tasks} is below one generation round's "
                          f"{plan.prompts_per_rank} prompts per process: the producer could never draw a round")
    settings = AsyncSettings(mode=args.rollout_mode, prompts_per_round=plan.prompts_per_rank,
                             steps_per_round=plan.optimizer_steps_per_round, max_inflight=inflight,
                             max_staleness=args.max_staleness, queue_maxsize=args.queue_maxsize,
                             weight_sync_steps=args.weight_sync_steps)
    return AsyncSource(parts=parts, settings=settings, push=push)


#: rollout_mode -> builder(args, plan, push, parts, rollout_context)
SOURCES: dict[str, Callable[..., ExperienceSource]] = {"sync": _lockstep, "one_step_off": _ahead, "async": _ahead}


def build_source(args: BaseRLConfig, plan: BatchPlan, push: Callable[[int], None], parts: SourceParts,
                 rollout_context: Any) -> ExperienceSource:
    """The source of ``args.rollout_mode`` (``push(step)`` sends the policy's weights to a sampler of its own;
    ``rollout_context``: the trainer's context around in-process generation)."""
    return SOURCES[args.rollout_mode](args, plan, push, parts, rollout_context)
