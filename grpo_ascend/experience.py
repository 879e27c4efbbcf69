"""One generation round as a typed record, made the same way for every algorithm.

:class:`ExperienceMaker` turns the next prompts into an :class:`Experience`: this rank's slice of
one global draw, G sampled completions per prompt, rewards per function, and the old (sampling
policy) and reference log-probs the update needs. GRPO and PPO differ only in what they add on
top (advantages; values and returns) and in their update.

Two masks describe the completion tokens: ``completion_mask`` marks the tokens in the context
(up to and including EOS); ``loss_mask`` marks those that count in the loss, the KL and every
token count. They differ for tokens the policy did not generate (a tool's response) and for
completions a setting leaves out of the loss (``mask_truncated_completions``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from grpo_ascend.algorithms.importance_sampling import (
    ImportanceSamplingSettings,
    importance_sampling_metrics,
    importance_sampling_weights,
    reduce_stats,
)
from grpo_ascend.data.prompts import is_conversational, row_prompt
from grpo_ascend.distributed.ranks import Ranks
from grpo_ascend.errors import DataError
from grpo_ascend.rollout.backend import RolloutBatch
from grpo_ascend.tracking.phases import PhaseTimer
from grpo_ascend.vision.inputs import RowVision

#: ``fn(prompt_ids, prompt_mask, completion_ids, completion_mask) -> [rows, Lc]`` log-probs.
LogprobFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Experience:
    """A round's completions on this rank; rows ``i*G .. i*G+G-1`` share prompt ``i``.

    Immutable: :class:`ExperienceMaker` builds the round's in one place (sampled and scored, then the
    old / reference log-probs and the algorithm's fields); a new view is a new object
    (:meth:`select`, :meth:`concat`, ``dataclasses.replace``).
    Tensors live on the training device. ``group_ids`` number the prompts of the global draw
    (equal ids = one group, also across ranks). ``advantages`` is [B] (one per completion) or
    [B, Lc] (per token); ``extras`` holds an algorithm's own per-row tensors (PPO's values and
    returns) and travels through :meth:`select` and :meth:`concat` like the rest.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    loss_mask: Tensor
    sampling_logps: Tensor
    truncated: Tensor
    rewards: Tensor
    rewards_per_function: Tensor
    reward_names: list[str]
    group_ids: Tensor
    prompts: list[Any]
    completions: list[Any]
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    #: Importance weights of the sampler/trainer mismatch per token (None: all 1) and their statistics.
    token_weights: Tensor | None = None
    importance_stats: dict[str, Tensor] = field(default_factory=dict)
    advantages: Tensor | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)
    #: Counts summed over the draws that made this experience (reward errors, refills).
    counts: dict[str, float] = field(default_factory=dict)
    #: What reward functions logged: ``log_metric`` values by name, ``log_extra`` columns (one value per row).
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    #: [B, Lc] the policy version that sampled each token (asynchronous rollouts); None: the current weights.
    policy_versions: Tensor | None = None
    #: Each row's image inputs (prompts with images; vision/inputs.py), None for text.
    vision: RowVision | None = None

    @property
    def size(self) -> int:
        return self.completion_ids.shape[0]

    def model_inputs(self, rows: Tensor | slice) -> tuple[Tensor, Tensor, Tensor, Tensor, RowVision | None]:
        """What the log-prob forward takes, for ``rows``: the four token tensors and the rows' image inputs."""
        vision = None
        if self.vision is not None:
            index = range(self.size)[rows] if isinstance(rows, slice) else rows.tolist()
            vision = self.vision.select(index)
        return (self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows], self.completion_mask[rows],
                vision)

    def _tensor_fields(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), Tensor)}

    def select(self, index: Tensor) -> Experience:
        """Rows ``index`` (a device tensor) of this experience."""
        host = index.tolist()
        tensors = {k: v[index.to(v.device)] for k, v in self._tensor_fields().items()}
        return dataclasses.replace(
            self, **tensors, prompts=[self.prompts[i] for i in host], completions=[self.completions[i] for i in host],
            extras={k: v[index.to(v.device)] for k, v in self.extras.items()}, counts=dict(self.counts),
            extra_columns={k: [v[i] for i in host] for k, v in self.extra_columns.items()},
            vision=self.vision.select(host) if self.vision is not None else None,
        )

    @classmethod
    def concat(cls, parts: Sequence[Experience], pad_token_id: int) -> Experience:
        """Join experiences row-wise; prompts are left-padded and completions right-padded to the widest."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        joined = {name: _cat([getattr(p, name) for p in parts], name, pad_token_id) for name in first._tensor_fields()}
        extras = {k: _cat([p.extras[k] for p in parts], k, pad_token_id) for k in first.extras}
        counts: dict[str, float] = {}
        metrics: dict[str, list[float]] = {}
        for p in parts:
            for k, v in p.counts.items():
                counts[k] = counts.get(k, 0.0) + v
            for k, values in p.reward_metrics.items():
                metrics.setdefault(k, []).extend(values)
        names = {k for p in parts for k in p.extra_columns}
        columns = {k: [x for p in parts for x in p.extra_columns.get(k, [None] * p.size)] for k in sorted(names)}
        return dataclasses.replace(
            first, **joined, prompts=[x for p in parts for x in p.prompts],
            completions=[x for p in parts for x in p.completions], extras=extras, counts=counts,
            reward_metrics=metrics, extra_columns=columns,
            vision=RowVision.concat([p.vision for p in parts], [p.size for p in parts]),
        )

    def samples(self, n: int) -> list[dict[str, Any]]:
        """The first ``n`` rows as JSON-ready records for samples.jsonl."""
        n = min(n, self.size)
        rewards = self.rewards[:n].tolist()
        adv = self.advantages
        advantages = adv[:n].tolist() if adv is not None and adv.dim() == 1 else [None] * n
        per_fn = self.rewards_per_function[:n].tolist()
        return [
            {
                "prompt": self.prompts[i],
                "completion": self.completions[i],
                "reward": rewards[i],
                "advantage": advantages[i],
                **{f"rewards/{name}": v for name, v in zip(self.reward_names, per_fn[i])},
                **{column: values[i] for column, values in self.extra_columns.items()},
            }
            for i in range(n)
        ]


def _cat(parts: list[Tensor], name: str, pad_token_id: int) -> Tensor:
    """Concatenate along rows; 2-D tensors are padded to the widest (prompt side on the left)."""
    if parts[0].dim() != 2 or name == "rewards_per_function":
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    fill = pad_token_id if name.endswith("_ids") else 0
    left = name.startswith("prompt")
    padded = []
    for p in parts:
        extra = width - p.shape[1]
        if extra:
            pad = p.new_full((p.shape[0], extra), fill)
            p = torch.cat([pad, p] if left else [p, pad], dim=1)
        padded.append(p)
    return torch.cat(padded)


@torch.no_grad()
def batched_logprobs(fn: LogprobFn, exp: Experience, micro_batch: int) -> Tensor:
    """Per-token log-probs of every completion under ``fn``, in micro-batches, without grad."""
    out = [fn(*exp.model_inputs(slice(s, s + micro_batch))) for s in range(0, exp.size, micro_batch)]
    return torch.cat(out)


class ExperienceSource(Protocol):
    """Where a trainer's scored completions come from: in lockstep with training
    (:class:`grpo_ascend.producers.lockstep.LockstepSource`) or from a producer running ahead of it
    (:class:`grpo_ascend.producers.asynchronous.AsyncSource`)."""

    def start(self, step: int, trainer_state: Callable[[], dict[str, Any]]) -> None:
        """``train()`` begins at optimizer step ``step``; ``trainer_state()`` is what reward functions receive."""

    def next_scored(self, prompts_per_rank: int, timer: PhaseTimer,
                    trainer_state: Callable[[], dict[str, Any]]) -> Experience:
        """This rank's next ``prompts_per_rank`` groups, sampled and scored (no old or reference log-probs)."""

    def policy_updated(self, step: int) -> None:
        """The trainer finished optimizer step ``step`` (every rank together): a source may push the weights."""

    def metrics(self) -> dict[str, float]:
        """This rank's numbers since the last call (staleness, idle time, ...); empty when it has none."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the source beyond the sampler's state (None: nothing)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict`'s state when resuming."""

    def close(self) -> None:
        """Stop what the source runs between rounds."""


#: ``complete(exp) -> (fields, metrics)``: an algorithm's own Experience fields (``advantages``, ``extras``, ...)
#: and its round metrics, from the annotated experience.
Completion = Callable[["Experience"], tuple[dict[str, Any], dict[str, float]]]


class ExperienceMaker:
    """Annotates a source's scored completions with what the update needs.

    ``source`` gives scored groups (see :class:`ExperienceSource`); ``policy_logprobs`` /
    ``reference_logprobs`` are the no-grad forwards of the training policy and of the reference
    (None: no reference). ``exact_sampling_logps``: the sampler's log-probs equal the training
    forward's (the built-in engine on the policy module in fp32), so the old log-probs need no
    extra forward. ``importance_sampling``: weight each token by the (bounded) ratio of the
    trainer's old log-probs to the sampler's (see algorithms/importance_sampling.py). When the batch
    feeds a single optimizer step (``old_logps=False``), the old policy is the one that step starts
    from: its log-probs are the training forward's, and the update computes the weights from them
    (:meth:`importance_weights_deferred`), without a forward of its own (TRL's rule too).
    """

    def __init__(
        self,
        *,
        source: ExperienceSource,
        micro_batch: int,
        policy_logprobs: LogprobFn,
        reference_logprobs: LogprobFn | None,
        exact_sampling_logps: bool,
        importance_sampling: ImportanceSamplingSettings | None = None,
    ) -> None:
        self.source = source
        self.micro_batch = micro_batch
        self.policy_logprobs = policy_logprobs
        self.reference_logprobs = reference_logprobs
        self.exact_sampling_logps = exact_sampling_logps
        self.importance_sampling = importance_sampling

    def make(
        self,
        prompts_per_rank: int,
        timer: PhaseTimer,
        *,
        old_logps: bool,
        trainer_state: Callable[[], dict[str, Any]],
        refill: Callable[[Experience, PhaseTimer], Experience] | None = None,
        complete: Completion | None = None,
    ) -> tuple[Experience, dict[str, float]]:
        """The next round, built once: scored groups from the source (``refill`` may replace groups), the
        old / reference log-probs and importance weights, then the algorithm's own fields and round metrics
        from ``complete`` (GRPO: advantages; PPO: values, returns, token advantages).

        ``trainer_state()`` is what reward functions receive as ``trainer_state``.
        """
        exp = self.source.next_scored(prompts_per_rank, timer, trainer_state)
        if refill is not None:
            exp = refill(exp, timer)
        fields: dict[str, Any] = {}
        if old_logps or (self.importance_sampling is not None and self.exact_sampling_logps):
            with timer.phase("old_logprobs"):
                fields["old_logps"] = exp.sampling_logps if self.exact_sampling_logps else batched_logprobs(
                    self.policy_logprobs, exp, self.micro_batch)
        if self.importance_sampling is not None and "old_logps" in fields:
            weights = importance_sampling_weights(exp.sampling_logps, fields["old_logps"], exp.loss_mask,
                                                  self.importance_sampling)
            fields["token_weights"], fields["importance_stats"] = weights.weights, weights.stats
        if self.reference_logprobs is not None:
            with timer.phase("reference"):
                fields["ref_logps"] = batched_logprobs(self.reference_logprobs, exp, self.micro_batch)
        annotated = dataclasses.replace(exp, **fields)
        if complete is None:
            return annotated, {}
        own, metrics = complete(annotated)
        return dataclasses.replace(annotated, **own), metrics

    def importance_weights_deferred(self, exp: Experience) -> bool:
        """Whether the update must weight ``exp``'s tokens itself, from its training forward's log-probs."""
        return self.importance_sampling is not None and exp.token_weights is None

    def sample_and_score(self, prompts_per_rank: int, timer: PhaseTimer,
                         trainer_state: Callable[[], dict[str, Any]]) -> Experience:
        """More scored groups from the source (DAPO's refill draws them)."""
        return self.source.next_scored(prompts_per_rank, timer, trainer_state)


@dataclass
class RolloutScores:
    """A rollout batch scored: what reward functions saw and returned, and what they logged."""

    completions: list[Any]
    completion_ids: list[list[int]]
    scored: Any
    logged: dict[str, list[float]]
    extra: dict[str, list[Any]]


def score_rollout(rewards: Any, rows: Sequence[Mapping[str, Any]], batch: RolloutBatch,
                  trainer_state: dict[str, Any]) -> RolloutScores:
    """Score ``batch`` (G completions per row of ``rows``) with every reward function; the dataset
    columns and the batch's ``extra_columns`` reach them as keyword arguments."""
    G = batch.num_generations
    prompts = [row_prompt(r) for r in rows]
    completions = completions_for_rewards(batch, is_conversational(prompts[0]))
    lengths = batch.completion_mask.sum(1).tolist()
    completion_ids = [ids[:n] for ids, n in zip(batch.completion_ids.tolist(), lengths)]
    columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
    columns.update(batch.extra_columns)
    logged: dict[str, list[float]] = {}
    extra: dict[str, list[Any]] = {}
    scored = rewards(
        [p for p in prompts for _ in range(G)], completions, completion_ids, columns, trainer_state=trainer_state,
        log_metric=lambda name, value: logged.setdefault(str(name), []).append(float(value)),
        log_extra=lambda column, values: extra.setdefault(str(column), []).extend(values),
    )
    for column, values in extra.items():
        if len(values) != len(completions):
            raise DataError(
                f"log_extra({column!r}, values) got {len(values)} values for {len(completions)} completions; "
                "a reward function logs one value per completion, once per call"
            )
    return RolloutScores(completions, completion_ids, scored, logged, extra)


def scored_experience(rewards: Any, rows: Sequence[Mapping[str, Any]], group_ids: Tensor, batch: RolloutBatch,
                      trainer_state: dict[str, Any], timer: PhaseTimer,
                      mask_truncated_completions: bool = False) -> Experience:
    """An :class:`Experience` of ``batch`` (sampled for ``rows``, global prompt ids ``group_ids``), scored."""
    G = batch.num_generations
    with timer.phase("reward"):
        scores = score_rollout(rewards, rows, batch, trainer_state)
    device = batch.completion_ids.device
    counts = {f"reward_errors/{k}": float(v) for k, v in scores.scored.error_counts.items()}
    counts.update(tool_counts(batch))
    return Experience(
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask.long(),
        completion_ids=batch.completion_ids,
        completion_mask=batch.completion_mask.long(),
        loss_mask=rollout_loss_mask(batch, mask_truncated_completions),
        sampling_logps=batch.sampling_logprobs,
        truncated=batch.truncated,
        rewards=scores.scored.total.to(device, torch.float32),
        rewards_per_function=scores.scored.per_function.to(device, torch.float32),
        reward_names=list(scores.scored.names),
        group_ids=group_ids.repeat_interleave(G).to(device),
        prompts=[row_prompt(r) for r in rows for _ in range(G)],
        completions=scores.completions,
        # Every function's count, zeros included, so every rank reduces the same keys.
        counts=counts,
        reward_metrics=scores.logged,
        extra_columns=scores.extra,
        policy_versions=batch.policy_versions,
        vision=batch.vision,
    )


def rollout_loss_mask(batch: RolloutBatch, mask_truncated_completions: bool = False) -> Tensor:
    """The loss mask of a rollout batch: its context mask, times its ``tool_mask`` when it has one
    (tool-response tokens stay in the context but out of the loss, the KL and every token count),
    times "not truncated" under ``mask_truncated_completions``."""
    loss_mask = batch.completion_mask.float()
    if batch.tool_mask is not None:
        loss_mask = loss_mask * batch.tool_mask.to(loss_mask.device, loss_mask.dtype)
    if mask_truncated_completions:
        loss_mask = loss_mask * (~batch.truncated).float().unsqueeze(1)
    return loss_mask


def completions_for_rewards(batch: RolloutBatch, conversational: bool) -> list[Any]:
    """What reward functions receive as ``completions``: texts, or message lists for chat prompts
    (the whole tool conversation, as TRL passes it, when the rollout has messages)."""
    texts = batch.completion_texts
    if not conversational:
        return list(texts)
    if batch.messages:
        return [list(m) for m in batch.messages]
    return [[{"role": "assistant", "content": t}] for t in texts]


#: Tool metrics that add up over rows and ranks (per-round sums in the metrics log).
_SUMMED_TOOL_METRICS = ("tools/failed_calls", "tools/time_s", "tools/truncated", "tools/length_limited",
                        "tools/iteration_limited")


def tool_counts(batch: RolloutBatch) -> dict[str, float]:
    """A multi-turn batch's tool numbers as round sums (calls, turns, failures by reason, seconds)."""
    metrics = batch.tool_metrics
    if not metrics:
        return {}
    rows = float(len(batch.completion_texts))
    counts = {k: float(v) for k, v in metrics.items() if k in _SUMMED_TOOL_METRICS or k.startswith("tools/failed/")}
    counts["tools/calls"] = metrics["tools/calls_per_completion"] * rows
    counts["tools/turns"] = metrics["tools/turns_per_completion"] * rows
    counts["tools/completions"] = rows
    return counts


def experience_metrics(exp: Experience, ranks: Ranks) -> dict[str, float]:
    """Reward (total and per function), length and truncation statistics over every rank's rows. As TRL, the
    total's statistics leave out completions no reward function scored (all None; their total is 0)."""
    per_fn = ranks.gather(exp.rewards_per_function)
    rewards = ranks.gather(exp.rewards)
    if per_fn.shape[1]:
        rewards = rewards[~per_fn.isnan().all(dim=1)]
    lengths = ranks.gather(exp.completion_mask.sum(1).float())
    truncated = ranks.gather(exp.truncated.float())
    stats = torch.stack([rewards.mean() if rewards.numel() else rewards.new_tensor(float("nan")),
                         rewards.std() if rewards.numel() > 1 else rewards.new_zeros(()),
                         lengths.mean(), lengths.min(), lengths.max(), truncated.mean()]).tolist()
    metrics = dict(zip(["reward", "reward_std", "completion_length/mean", "completion_length/min",
                        "completion_length/max", "truncated_fraction"], stats))
    means = torch.nanmean(per_fn, dim=0).tolist()
    stds = [float(per_fn[:, i][~per_fn[:, i].isnan()].std()) if per_fn.shape[0] > 1 else 0.0
            for i in range(per_fn.shape[1])]
    for name, m, s in zip(exp.reward_names, means, stds):
        metrics[f"rewards/{name}/mean"] = m
        metrics[f"rewards/{name}/std"] = s
    metrics["tokens_generated"] = float(lengths.sum())
    metrics.update(ranks.mean_over_ranks(
        {name: sum(values) / len(values) for name, values in exp.reward_metrics.items() if values}))
    if exp.importance_stats:
        metrics.update(importance_sampling_metrics(reduce_stats(exp.importance_stats, ranks.sum_scalars)))
    metrics.update(ranks.sum_scalars({k: torch.tensor(v, device=exp.rewards.device) for k, v in exp.counts.items()}))
    if metrics.get("tools/completions"):
        metrics["tools/calls_per_completion"] = metrics["tools/calls"] / metrics["tools/completions"]
        metrics["tools/turns_per_completion"] = metrics["tools/turns"] / metrics["tools/completions"]
        # TRL 1.16's names: calls per completion, and failed calls per call.
        metrics["tools/call_frequency"] = metrics["tools/calls_per_completion"]
        metrics["tools/failure_frequency"] = metrics["tools/failed_calls"] / max(metrics["tools/calls"], 1.0)
    return metrics
