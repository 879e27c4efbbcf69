"""Evaluation, a part the trainer holds: the eval sets (checked before anything loads), ``evaluate()``'s
metrics, and when evaluation is due during training (``eval_strategy``). The best checkpoint is
trainers/best_tracking.py's; logging the metrics is the trainer's.

Evaluation never changes training: each engine call samples from its own generator (seeded from
``seed`` and the call's chunk of the eval set, the same noise at every evaluation, so two
evaluations differ only by the weights), and the global RNG states it may touch are restored
afterwards. The eval set is cut into chunks dealt to the ranks in turn (:func:`eval_chunks`), so
the completions, and the metrics summed over ranks with one collective (see
grpo_ascend/eval_metrics.py), are those of one process. Every rank enters one
rollout context (sharded engines gather the whole weights there, all ranks together);
inside it generation makes no collective calls, so the ranks' chunk counts may differ.
Tool-calling and ``rollout_func`` runs evaluate through the run's rollout (its
:meth:`~grpo_ascend.rollout.protocol.Rollout.for_evaluation` copy: environments of its own).

An algorithm with a loss to report (TRL's ``eval_loss``) gives an :class:`EvalLoss` hook: after the
sampled pass, every rank enters its context once and the hook scores each of its batches; ``loss`` is
their mean weighted by rows (summed over ranks like the rest), also returned as ``<prefix>_loss``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from grpo_ascend import device as dev
from grpo_ascend.config.configs import BaseRLConfig
from grpo_ascend.config.loader_settings import check_stream_dispatch
from grpo_ascend.data.prompts import check_prompt_dataset, eval_prompt_rows
from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.errors import ConfigError
from grpo_ascend.eval_metrics import TOOL_SUMS, eval_sums, finish_eval_metrics, resolved_eval_steps
from grpo_ascend.experience import RolloutScores, score_rollout, tool_counts
from grpo_ascend.rollout.backend import RolloutBatch
from grpo_ascend.rollout.protocol import Rollout
from grpo_ascend.trainers.run_state import RunState

logger = logging.getLogger(__name__)

#: Offset of the evaluation generator's seed from the run's seed (a stream of its own).
_EVAL_SEED_OFFSET = 50_000_017


class EvalLoss(Protocol):
    """An algorithm's evaluation loss (GRPO: trainers/eval_loss.py; None where there is none, as PPO)."""

    def context(self) -> contextlib.AbstractContextManager:
        """Entered once by every rank around a set's loss calls (the calls themselves make no collective calls)."""

    def __call__(self, rows: Sequence[Mapping[str, Any]], batch: RolloutBatch, scores: RolloutScores) -> float:
        """The loss of one sampled eval batch (``batch.num_generations`` completions per row of ``rows``)."""


class EvalSets:
    """The trainer's eval sets, checked when the trainer is made (before any model loads); a stream is
    read into rows once. ``dataset`` is what the trainer was given (one set, a dict of named sets, or None)."""

    def __init__(self, eval_dataset: Any, args: BaseRLConfig, require_prompt: bool = True):
        self._rows: dict[int, Any] = {}  # by id, streams read once into rows
        self.args = args
        self.require_prompt = require_prompt
        if isinstance(eval_dataset, Mapping):
            if not eval_dataset:
                raise ConfigError("eval_dataset is an empty dict: give {name: dataset, ...} or one dataset")
            for dataset in eval_dataset.values():
                self._rows[id(dataset)] = _checked_eval_rows(dataset, require_prompt)
        elif eval_dataset is not None:
            self._rows[id(eval_dataset)] = _checked_eval_rows(eval_dataset, require_prompt)
        elif args.eval_strategy != "no":
            raise ConfigError(f"eval_strategy is {args.eval_strategy!r} but there is no eval dataset: pass "
                              "eval_dataset= (recipes: eval_dataset, eval_split or eval_fraction), or set eval_strategy: no")
        self.dataset = eval_dataset

    def datasets(self) -> list[Any]:
        """The eval sets the trainer was given, as rows."""
        return list(self._rows.values())

    def resolve(self, eval_dataset: Any, prefix: str) -> list[tuple[str, Any]]:
        """(metric prefix, indexable rows) of each set ``evaluate(eval_dataset, prefix)`` evaluates, in order.

        A name picks one of the trainer's named sets; a dict (or ``DatasetDict``) is evaluated set by
        set, each under ``<prefix>_<name>`` as in transformers.
        """
        named = self.dataset if isinstance(self.dataset, Mapping) else {}
        if isinstance(eval_dataset, str):
            if eval_dataset not in named:
                raise ConfigError(f"evaluate({eval_dataset!r}): the trainer's eval sets are "
                                  f"{sorted(named) if named else 'not named (one dataset)'}")
            return self.resolve(named[eval_dataset], f"{prefix}_{eval_dataset}")
        dataset = eval_dataset if eval_dataset is not None else self.dataset
        if dataset is None:
            raise ConfigError("evaluate() has no dataset: pass eval_dataset= to the trainer or to evaluate()")
        if isinstance(dataset, Mapping):
            return [entry for name, part in dataset.items() for entry in self.resolve(part, f"{prefix}_{name}")]
        rows = self._rows.get(id(dataset))
        if rows is None:  # a set given to evaluate() only: TRL's rule for streams applies to it now
            check_stream_dispatch(self.args, dataset)
            rows = _checked_eval_rows(dataset, self.require_prompt)
        return [(prefix, rows)]


class Evaluator:
    """Generates and scores eval sets through the run's rollout; says when an in-run evaluation is due.

    ``rollout_context``: the trainer's context around generation (eval mode, autocast, whole weights,
    LoRA folded in); ``reward_state``: ``trainer_state`` as reward functions receive it; ``eval_loss``: the
    algorithm's loss hook (None: no ``loss`` metric).
    """

    def __init__(self, *, args: BaseRLConfig, sets: EvalSets, run: RunState, rollout: Rollout, rewards: Any, ranks: Ranks,
                 device: torch.device, policy: Any, rollout_context: Callable[[], contextlib.AbstractContextManager],
                 reward_state: Callable[[], dict[str, Any]], eval_loss: EvalLoss | None = None):
        self.args = args
        self.sets = sets
        self.run = run
        self.training_rollout = rollout
        self.rewards = rewards
        self.ranks = ranks
        self.policy = policy
        self.rollout_context = rollout_context
        self.reward_state = reward_state
        self.device = device
        self.eval_loss = eval_loss
        self._eval_rollout: Rollout | None = None  # made at the first evaluation (see rollout)

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates during training."""
        return self.args.eval_strategy != "no" and self.sets.dataset is not None

    def due(self) -> bool:
        """Whether an eval step was crossed in the round just finished (evaluations sit at round ends)."""
        if not self.enabled:
            return False
        every = resolved_eval_steps(self.args)
        return self.run.step // every > max(self.run.last_eval_step, 0) // every

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> list[dict[str, float]]:
        """One record per eval set (see :meth:`EvalSets.resolve`), its metrics named ``<prefix>/<metric>``;
        every rank must call."""
        records = []
        for prefix, rows in self.sets.resolve(eval_dataset, metric_key_prefix):
            started = time.perf_counter()
            sums, names, n = self._eval_sums(rows)
            metrics = finish_eval_metrics(self._sum_over_ranks(sums), names, n)
            metrics["runtime"] = time.perf_counter() - started
            record = {f"{prefix}/{k}": v for k, v in metrics.items()}
            if "loss" in metrics:  # transformers' / TRL's name too: eval_loss, eval_<set>_loss
                record[f"{prefix}_loss"] = metrics["loss"]
            records.append(record)
        return records

    # ------------------------------------------------------------------------------ generation
    def _eval_sums(self, dataset: Any) -> tuple[dict[str, float], list[str], int]:
        """This rank's additive statistics over its chunks of ``dataset`` (see :func:`eval_chunks`)."""
        args, ranks = self.args, self.ranks
        base = self.training_rollout.params
        n = args.num_generations_eval or base.num_generations
        temperature = args.eval_temperature if args.eval_temperature is not None else base.temperature
        sampled_params = dataclasses.replace(base, num_generations=n, temperature=temperature)
        greedy_params = dataclasses.replace(base, num_generations=1, temperature=0.0)
        chunks = eval_chunks(len(dataset), max(1, args.per_device_eval_batch_size // n), ranks.rank, ranks.world)
        generator = torch.Generator(device=self.device)
        saved_rng = dev.rng_state(self.device)
        was_training = self.policy.training
        sampled, greedy = [], []
        try:
            rollout = self.rollout
            with torch.no_grad(), self.rollout_context():  # all ranks enter once (whole weights if sharded)
                for index, rows in chunks:
                    chunk = [dataset[i] for i in rows]
                    # Seeded by the chunk's place in the eval set: the same completions on any number of ranks.
                    generator.manual_seed(args.seed + _EVAL_SEED_OFFSET + index)
                    sampled.append(self._eval_generate(rollout, chunk, sampled_params, generator))
                    greedy.append(self._eval_generate(rollout, chunk, greedy_params, None))
            loss_sums = self._loss_sums(sampled) if self.eval_loss is not None else {}
        finally:
            dev.set_rng_state(saved_rng, self.device)
            self.policy.train(was_training)
        names = sampled[0]["names"] if sampled else list(self.rewards.names)
        sums = eval_sums(_join(sampled, len(names)), _join(greedy, len(names)), names, n, args.eval_pass_threshold)
        sums.update(loss_sums)
        if any(part["tools"] for part in sampled):  # tool calls of the sampled pass (multi-turn rollouts)
            for key in TOOL_SUMS:
                sums[f"sampled/{key}"] = sum(part["tools"].get(key, 0.0) for part in sampled)
        return sums, names, n

    def _loss_sums(self, sampled: list[dict[str, Any]]) -> dict[str, float]:
        """The loss hook over this rank's sampled batches: the row-weighted sum and the rows (every rank
        enters the hook's context once, also with no batch)."""
        assert self.eval_loss is not None
        total = rows = 0.0
        with torch.no_grad(), self.eval_loss.context():
            for part in sampled:
                size = float(part["batch"].completion_ids.shape[0])
                total += self.eval_loss(part["rows"], part["batch"], part["scores"]) * size
                rows += size
        return {"sampled/loss_sum": total, "sampled/loss_rows": rows}

    @property
    def rollout(self) -> Rollout:
        """The rollout evaluation generates with: the run's rollout's evaluation copy, made once."""
        if self._eval_rollout is None:
            self._eval_rollout = self.training_rollout.for_evaluation()
        return self._eval_rollout

    def _sum_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """``sums`` added over every rank, in double precision (the pass counts and the reward squares
        need it; a float32 reduce would differ from one process in the sixth digit)."""
        if self.ranks.world == 1:
            return sums
        from accelerate.utils import gather_object

        total: dict[str, float] = {}
        for part in gather_object([sums]):  # one small object per rank, in rank order
            for key, value in part.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def _eval_generate(self, rollout: Rollout, rows: list[dict[str, Any]], params: Any,
                       generator: Any) -> dict[str, Any]:
        """Generate and score one chunk of eval prompts through the training rollout path (tools,
        environments, ``rollout_func`` included); reward logging calls are ignored."""
        batch = rollout.generate_rows(rows, params, generator)
        scores = score_rollout(self.rewards, rows, batch, self.reward_state())
        part = {"total": scores.scored.total.float().cpu(), "per_function": scores.scored.per_function.float().cpu(),
                "lengths": batch.completion_mask.sum(1).cpu(), "names": list(scores.scored.names),
                "tools": tool_counts(batch)}
        if self.eval_loss is not None:  # kept for the loss, computed after generation (see _loss_sums)
            part.update(rows=rows, batch=batch, scores=scores)
        return part


def eval_chunks(size: int, per_call: int, rank: int, world: int) -> list[tuple[int, range]]:
    """This rank's engine calls over an eval set of ``size`` prompts: (chunk index, prompt indices).

    The set is cut into chunks of ``per_call`` prompts and the chunks are dealt to the ranks in
    turn, so a chunk holds the same prompts (and gets the same seed) whatever the number of ranks;
    ranks may get one chunk more than others, or none (generation makes no collective calls).
    """
    starts = range(0, size, per_call)
    return [(i, range(s, min(s + per_call, size))) for i, s in enumerate(starts)][rank::world]


def _checked_eval_rows(dataset: Any, require_prompt: bool = True) -> Any:
    """An eval set checked (prompt column unless ``require_prompt`` is False, not empty) and indexable by row
    (a stream is read into rows)."""
    check_prompt_dataset(dataset, require_prompt=require_prompt)
    return eval_prompt_rows(dataset)


def _join(parts: list[dict[str, Any]], num_functions: int) -> dict[str, Any]:
    """Concatenate chunk results (an empty slice gives empty tensors of the right widths)."""
    if not parts:
        return {"total": torch.zeros(0), "per_function": torch.zeros(0, num_functions), "lengths": torch.zeros(0)}
    return {key: torch.cat([p[key] for p in parts]) for key in ("total", "per_function", "lengths")}
