"""Optimizer steps cut from a stream of generation batches, where a step may straddle two of them.

TRL lets ``steps_per_generation`` (micro-batches per generation batch, times ``num_iterations``) be any
number, not only a multiple of ``gradient_accumulation_steps``: micro-batches are consumed in order and
an optimizer step takes the next ``gradient_accumulation_steps`` of them, from whichever generation
batches they come. A step is therefore a list of :class:`Segment` (rows of one generation batch each);
when steps line up with generation batches, as by default, every step is one segment.

Each segment keeps its own generation batch's token count: the ``dapo``/``cispo``/``vespo`` loss divides
a micro-batch by the tokens per optimizer step *of its generation batch* (TRL's rule), while the
step-wide totals (sequences, tokens) count every segment.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import Tensor

from grpo_ascend.algorithms.losses import LossNormaliser
from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.experience import Experience
from grpo_ascend.trainers.base import RoundLog


@dataclass
class Segment:
    """Rows (positions into ``exp``) one optimizer step takes from one generation batch."""

    exp: Experience
    rows: Tensor
    tokens_global: Tensor  # valid completion tokens of the whole generation batch, all ranks
    log: RoundLog


def step_parts(stream: Tensor, rows_per_step: int, carried: int) -> Iterator[tuple[Tensor, bool]]:
    """``stream`` (a generation batch's rows in training order) cut into the parts of successive optimizer
    steps, each with whether it completes its step. The first step already holds ``carried`` rows from
    earlier generation batches; the last part may be incomplete (it is carried into the next batch)."""
    start, need = 0, rows_per_step - carried
    while start < stream.numel():
        part = stream[start : start + need]
        yield part, part.numel() == need
        start, need = start + need, rows_per_step


def straddling_normalisers(segments: Sequence[Segment], ranks: Ranks, grad_accum: int,
                           steps_per_generation: int) -> list[LossNormaliser]:
    """One normaliser per segment of a step: the step's sequences and tokens (all ranks, per rank as in
    :class:`LossNormaliser`), and its own generation batch's tokens × grad_accum / steps_per_generation."""
    world = ranks.world
    rows = sum(int(s.rows.numel()) for s in segments)
    tokens = ranks.reduce(sum(s.exp.loss_mask[s.rows].sum() for s in segments)) / world
    return [LossNormaliser(num_sequences=rows, num_tokens=tokens,
                           num_tokens_per_step_global=s.tokens_global * grad_accum / (steps_per_generation * world))
            for s in segments]


def step_log(segments: Sequence[Segment]) -> RoundLog:
    """The log a step's record carries: its newest generation batch's, with the rollout metrics of earlier
    batches that no step has logged yet averaged in (so a batch that completes no step of its own is
    still seen) and their preparation time added."""
    newest = segments[-1].log
    unlogged: list[RoundLog] = []
    for s in segments[:-1]:
        if s.log.steps == 0 and s.log is not newest and all(s.log is not u for u in unlogged):
            unlogged.append(s.log)
    if unlogged:
        logs = [*unlogged, newest]
        keys = dict.fromkeys(k for log in logs for k in log.metrics)
        newest.metrics = {k: sum(log.metrics[k] for log in logs if k in log.metrics) /
                          sum(k in log.metrics for log in logs) for k in keys}
        newest.prep_seconds += sum(log.prep_seconds for log in unlogged)
        for log in unlogged:
            log.steps = 1  # charged: averaged in once
    return newest
