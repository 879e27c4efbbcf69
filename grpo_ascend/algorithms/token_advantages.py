"""PPO's per-token advantages for causal LMs: KL-penalised token rewards, GAE, whitening over every
rank's tokens, and the round's statistics.

An estimator takes the round's scores, log-probs, values and mask and returns
:class:`TokenAdvantages`; ``reduce`` / ``gather`` are the ranks' sum all-reduce and all-gather
(identity on one process), so whitening and the statistics cover every rank's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_ascend.algorithms.gae import gae_advantages, whiten
from grpo_ascend.algorithms.kl_control import token_rewards
from grpo_ascend.algorithms.registry import Registry

Collective = Callable[[Tensor], Tensor]


@dataclass
class TokenAdvantages:
    """An estimator's result, all [B, T] and zero at masked tokens.

    ``advantages``: what the policy loss uses (whitened unless asked not to); ``raw_advantages``:
    before whitening; ``returns``: the value targets; ``kl``: the per-token KL estimate
    (log π − log π_ref) the rewards were penalised with, at coefficient ``kl_coef``.
    """

    advantages: Tensor
    raw_advantages: Tensor
    returns: Tensor
    kl: Tensor
    kl_coef: float

    def metrics(self, values: Tensor, mask: Tensor, reduce: Collective, gather: Collective) -> tuple[dict[str, float], int]:
        """The round's statistics over all ranks (one gather, one reduction, one host copy) and the
        number of sequences they cover. ``kl/sequence`` is the mean KL summed over a sequence."""
        kl, returns, raw = self.kl, self.returns, self.raw_advantages
        seq_kl = gather(kl.sum(1))
        sums = reduce(torch.stack([
            kl.sum(), (-self.kl_coef * kl).sum(), returns.sum(), values.sum(), raw.sum(),
            ((returns - values) * mask).sum(), ((returns - values) ** 2 * mask).sum(), (returns * mask).pow(2).sum(),
            mask.sum(),
        ]))
        stats = torch.cat([sums, seq_kl.mean().reshape(1)]).tolist()
        kl_sum, non_score_sum, ret_sum, val_sum, adv_sum, err_sum, err_sq, ret_sq, n_tok, seq_kl_mean = stats
        n_seq, n = seq_kl.numel(), max(n_tok, 1.0)
        var_ret = ret_sq / n - (ret_sum / n) ** 2
        var_err = err_sq / n - (err_sum / n) ** 2
        return {
            "kl": kl_sum / n,
            "kl/sequence": seq_kl_mean,
            "kl_coef": self.kl_coef,
            "non_score_reward": non_score_sum / max(n_seq, 1),
            "returns/mean": ret_sum / n,
            "values/mean": val_sum / n,
            "advantages/mean": adv_sum / n,
            "explained_variance": 1.0 - var_err / var_ret if var_ret > 1e-12 else 0.0,
        }, n_seq


TokenAdvantageEstimator = Callable[..., TokenAdvantages]
TOKEN_ADVANTAGE_ESTIMATORS: Registry[TokenAdvantageEstimator] = Registry("token advantage estimator")


@TOKEN_ADVANTAGE_ESTIMATORS.register("gae")
def gae_token_advantages(scores: Tensor, logps: Tensor, ref_logps: Tensor | None, values: Tensor, mask: Tensor,
                         kl_coef: float, gamma: float, lam: float, whiten_advantages: bool = True,
                         reduce: Collective | None = None) -> TokenAdvantages:
    """Token rewards r_t = −kl_coef·(log π − log π_ref)_t plus the score on each row's last token
    (:func:`~grpo_ascend.algorithms.kl_control.token_rewards`), GAE over them (``gamma``, ``lam``), and the
    advantages whitened over the valid tokens of every rank (``reduce``) when ``whiten_advantages``."""
    rewards, kl = token_rewards(scores, logps, ref_logps, mask, kl_coef)
    raw, returns = gae_advantages(rewards, values, mask, gamma, lam)
    advantages = whiten(raw, mask, reduce=reduce) if whiten_advantages else raw
    return TokenAdvantages(advantages, raw, returns, kl, kl_coef)
