"""GRPO's evaluation loss: TRL 1.16's ``eval_loss`` (``evaluate()``'s ``eval_loss`` / ``eval_<set>_loss``).

The loss of one scored eval batch, no gradient: group-relative advantages from the batch's own groups
(``num_generations_eval`` completions per prompt; a group of one has no baseline, advantage 0), the current
policy as the old policy (every ratio is 1), the KL term to the reference when ``beta`` > 0, the entropy
bonus with this step's coefficient, the importance-sampling correction when it is on, the loss type's own
normaliser over this batch alone (no accumulation, as TRL's evaluation). ``top_entropy_quantile`` selects
within the batch on this rank (evaluation makes no collective calls).
:class:`~grpo_ascend.trainers.evaluating.Evaluator` averages it over batches, weighted by their rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.algorithms.importance_sampling import ImportanceSamplingSettings, importance_sampling_weights
from grpo_ascend.algorithms.losses import PolicyLossBatch, PolicyLossSettings, policy_loss
from grpo_ascend.algorithms.reward_aggregation import GroupedRewards, aggregate_advantages
from grpo_ascend.algorithms.token_selection import entropy_quantile_mask
from grpo_ascend.experience import RolloutScores, rollout_loss_mask
from grpo_ascend.rollout.backend import RolloutBatch

#: ``fn(prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=..., with_entropy=...)``
#: -> (log-probs, entropies or None), as models/policy.py's CompletionLogprobs.
LogprobForward = Callable[..., tuple[Tensor, Tensor | None]]


def eval_advantages(scores: RolloutScores, num_generations: int, reward_weights: Tensor, args: Any,
                    device: torch.device) -> Tensor:
    """[rows] advantages of a scored eval batch, by the run's aggregation and estimator over its own groups."""
    total = scores.scored.total.to(device, torch.float32)
    if num_generations < 2:
        return torch.zeros_like(total)
    grouped = GroupedRewards(scores.scored.per_function.to(device, torch.float32), total,
                             reward_weights.to(device), num_generations)
    return aggregate_advantages(args.multi_objective_aggregation, grouped, args.advantage_estimator,
                                args.scale_rewards).advantages.float()


@dataclass
class GRPOEvalLoss:
    """The evaluator's loss hook for GRPO (see the module docstring and ``EvalLoss`` in trainers/evaluating.py).

    ``forward``: the policy's log-prob forward, collective-free (not the data-parallel wrapper);
    ``reference``: the reference's log-probs of the same four tensors (used when ``beta`` > 0);
    ``settings``: the loss settings with the entropy coefficient this step applies; ``scope``: what every rank
    enters once around a set's batches (eval mode, autocast, whole weights of a sharded policy).
    """

    args: Any
    reward_weights: Tensor
    forward: LogprobForward
    reference: Callable[..., Tensor]
    settings: Callable[[], PolicyLossSettings]
    importance_sampling: ImportanceSamplingSettings | None
    scope: Callable[[], contextlib.AbstractContextManager]

    def context(self) -> contextlib.AbstractContextManager:
        return self.scope()

    def __call__(self, rows: Sequence[Mapping[str, Any]], batch: RolloutBatch, scores: RolloutScores) -> float:
        """The GRPO loss of ``batch`` (``batch.num_generations`` completions per row of ``rows``, scored)."""
        args = self.args
        inputs = (batch.prompt_ids, batch.prompt_mask.long(), batch.completion_ids, batch.completion_mask.long())
        mask = rollout_loss_mask(batch, args.mask_truncated_completions)
        logps, entropies = self.forward(*inputs, temperature=args.temperature, with_entropy=True)
        settings = self.settings()
        weights = None
        if self.importance_sampling is not None:
            weights = importance_sampling_weights(batch.sampling_logprobs, logps, mask, self.importance_sampling).weights
        selection = None
        if args.top_entropy_quantile < 1.0 and entropies is not None:
            selection = entropy_quantile_mask(entropies, mask, 1.0 - args.top_entropy_quantile)
        loss_batch = PolicyLossBatch(
            logps=logps, mask=mask, entropies=entropies, weights=weights, selection=selection,
            advantages=eval_advantages(scores, batch.num_generations, self.reward_weights, args, logps.device),
            ref_logps=self.reference(*inputs) if settings.beta > 0 else None,
            sampling_logps=batch.sampling_logprobs,
        )
        return float(policy_loss(args.loss_type, loss_batch, settings)[0])
