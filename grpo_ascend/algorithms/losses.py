"""Policy losses (GRPO, BNPO, Dr. GRPO, DAPO, CISPO, SAPO, LUSPO, VESPO; token- or sequence-level ratios), PPO's
value loss.

Exact gradient accumulation
---------------------------
Every loss returns ``sum of its contributions over the micro-batch / normaliser`` where the
normaliser describes the whole *optimizer step* (all its micro-batches), not the micro-batch.
Backward'ing each micro-batch's loss and summing the gradients therefore gives exactly the
gradient of the full-batch loss, whatever the micro-batch split and padding. The trainer builds
one :class:`LossNormaliser` per optimizer step (``LossNormaliser.for_step``) and must NOT divide
the loss by ``gradient_accumulation_steps`` again.

Aggregation per ``loss_type`` (L_it the per-token loss, m_it the 0/1 mask, T_i = Σ_t m_it):

* ``grpo``    (DeepSeekMath): Σ_i [Σ_t L_it m_it / max(T_i, 1)] / num_sequences
                              — mean over sequences of per-sequence token means.
* ``bnpo``    : Σ_it L_it m_it / num_tokens — token mean over the optimizer step (all ranks).
* ``dr_grpo`` : Σ_it L_it m_it / (num_sequences × max_completion_length) — constant denominator.
* ``dapo``    : Σ_it L_it m_it / num_tokens_per_step_global — token mean over the whole
                generation batch, so every token weighs the same across steps and ranks.
* ``luspo``   : Σ_i [Σ_t L_it m_it] / num_sequences — mean over sequences of each sequence's token *sum*
                (length-unbiased sequence policy optimization; meant for sequence-level ratios).

The normaliser fields are defined in :mod:`grpo_ascend.algorithms.loss_inputs`.

``mask_truncated_completions``: the caller zeroes the mask rows of completions that hit
``max_completion_length`` without an EOS *before* building the batch and the normaliser, so they
contribute nothing and are not counted.

Per-token objective (r the importance ratio, A the advantage, w the optional importance-sampling
correction weight of the sampler/trainer mismatch, 1 when absent):
``L = w·P(r, A) + β·KL(logp, ref)·[r if use_bias_correction_kl] − entropy_coef·H`` (H the step's mean per-token
entropy whatever the loss type, as TRL; the other terms aggregated per loss type) with the policy
term P per loss type: ``−min(min(r, δ)·A, clip(r, 1−ε, 1+ε_high)·A)`` for grpo/bnpo/dr_grpo/dapo,
``−sg[min(r, ε_high)]·A·logp`` for cispo (aggregated like dapo), ``−σ(τ(r−1))·4/τ·A`` for sapo
(aggregated like grpo; τ per advantage sign), ``−sg[φ(w_i)]·A·logp`` for vespo (aggregated like dapo; φ the
gamma weight of the sequence ratio w_i = Π_t r_it, see :func:`vespo_gamma_weights`), the clipped objective
for luspo. KL is the ``kl_estimator`` (k1, k2 or k3 =
``exp(ref − logp) − (ref − logp) − 1``, the default). The min(r, δ) cap (TRL's two-sided clipping) is
applied only when ``delta`` is set. With ``importance_sampling_level="sequence"`` (GSPO) every
token of sequence i uses s_i = exp(mean over its valid tokens of (logp − old_logp)), broadcast with
its gradient (as TRL), so the gradient at token t of a sequence-constant term is s_i·mean_u ∇logp_u:
GSPO's sequence-level gradient under ``grpo``, and the same as the GSPO-token form under every other
aggregation (all weigh the tokens of a sequence equally) unless per-token ``weights`` differ.

Token selection (TRL 1.16's meanings), each multiplying the policy term only, never the normalisers:
``off_policy_mask_threshold`` δ (DeepSeek-V3.2's off-policy sequence masking) drops sequence i when
A_i < 0 and mean_t (sampling_logp − logp) > δ; ``batch.selection`` (e.g. the high-entropy tokens of
``top_entropy_quantile``, see :mod:`grpo_ascend.algorithms.token_selection`) keeps only the selected tokens, for
the entropy bonus too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from grpo_ascend.algorithms.kl import KL_ESTIMATORS
from grpo_ascend.algorithms.loss_inputs import (  # noqa: F401  (re-exported: the losses' public inputs)
    IMPORTANCE_SAMPLING_LEVELS,
    LossNormaliser,
    Number,
    PolicyLossBatch,
    PolicyLossSettings,
)
from grpo_ascend.algorithms.registry import Registry
from grpo_ascend.algorithms.token_selection import off_policy_sequence_mask
from grpo_ascend.errors import ConfigError, DataError

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("loss_type")
# A per-token policy-gradient objective: (ratio, advantages, logps, settings) → (term, low, high), where
# term is the per-token loss and low/high mark the tokens its clipping holds back (for the stats).
Objective = Callable[[Tensor, Tensor, Tensor, PolicyLossSettings], tuple[Tensor, Tensor, Tensor]]


def _at_least_one(x: Number) -> Number:
    return x.clamp(min=1) if isinstance(x, Tensor) else max(x, 1)


def _check_shapes(batch: PolicyLossBatch) -> None:
    shape = batch.logps.shape
    if batch.logps.dim() != 2:
        raise DataError(f"logps must be [B, T], got shape {tuple(shape)}")
    for name in ("mask", "old_logps", "ref_logps", "entropies", "sampling_logps", "selection"):
        t = getattr(batch, name)
        if t is not None and t.shape != shape:
            raise DataError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logps")
    for name in ("advantages", "weights"):
        t = getattr(batch, name)
        if t is not None and not (t.shape == shape[:1] or t.shape == shape):
            raise DataError(f"{name} must be [B] or [B, T] = {tuple(shape)}, got {tuple(t.shape)}")


def clipped_objective(
    ratio: Tensor, adv: Tensor, logps: Tensor, settings: PolicyLossSettings
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO/GRPO: −min(min(r, δ)·A, clip(r, 1−ε, 1+ε_high)·A)."""
    clipped_ratio = ratio.clamp(1 - settings.epsilon, 1 + settings.eps_high)
    capped_ratio = ratio if settings.delta is None else ratio.clamp(max=settings.delta)
    r = ratio.detach()
    low = (r < 1 - settings.epsilon) & (adv < 0)
    high = (r > 1 + settings.eps_high) & (adv > 0)
    return -torch.minimum(capped_ratio * adv, clipped_ratio * adv), low, high


def cispo_objective(
    ratio: Tensor, adv: Tensor, logps: Tensor, settings: PolicyLossSettings
) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO (MiniMax-M1): −sg[min(r, ε_max)]·A·log π_θ; the weight is clipped, never the gradient.

    ε_max is ``epsilon_high`` taken as an absolute cap on r (TRL 1.16; ScaleRL recommends 5.0).
    """
    r = ratio.detach()
    weight = r.clamp(max=settings.eps_high)
    high = (r > settings.eps_high) & (adv > 0)
    return -weight * adv * logps, torch.zeros_like(high), high


def sapo_objective(
    ratio: Tensor, adv: Tensor, logps: Tensor, settings: PolicyLossSettings
) -> tuple[Tensor, Tensor, Tensor]:
    """SAPO: −f_τ(r)·A with the soft gate f_τ(r) = σ(τ(r − 1))·4/τ (gradient A·∇r at r = 1).

    τ = ``sapo_temperature_pos`` where A > 0, ``sapo_temperature_neg`` elsewhere. No hard clipping.
    """
    tau = torch.where(
        adv > 0,
        torch.as_tensor(settings.sapo_temperature_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(settings.sapo_temperature_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    none = torch.zeros(ratio.shape, dtype=torch.bool, device=ratio.device)
    return -gate * adv, none, none


def per_token_policy_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, objective: Objective = clipped_objective
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss [B, T] (zero at masked tokens) and detached stat SUMS over valid tokens.

    ``objective`` gives the policy-gradient term (``clipped_objective`` for grpo/bnpo/dr_grpo/dapo).
    Stats: clipped_low, clipped_high, clipped_region (either) — the tokens the objective's clipping
    holds back —, kl_sum (the KL term as it enters the loss, before β), entropy_sum, ratio_sum,
    token_count. Summing them over micro-batches (and ranks) and dividing by the summed token_count
    gives exact batch means.
    """
    _check_shapes(batch)
    if settings.beta > 0 and batch.ref_logps is None:
        raise DataError(f"beta={settings.beta} > 0 needs ref_logps (the reference model's log-probs)")
    if settings.entropy_coef != 0 and batch.entropies is None:
        raise DataError(f"entropy_coef={settings.entropy_coef} != 0 needs per-token entropies")

    logps = batch.logps
    valid = batch.mask.bool()
    m = valid.to(logps.dtype)
    zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
    old = logps.detach() if batch.old_logps is None else batch.old_logps
    # torch.where (not multiplication by the mask) keeps inf/NaN at padded positions out of
    # both the values and the gradients.
    log_ratio = torch.where(valid, logps - old, zero)
    if settings.importance_sampling_level == "sequence":
        seq_log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        log_ratio = seq_log_ratio.expand_as(log_ratio)
    ratio = torch.exp(log_ratio)

    adv = batch.advantages.to(logps.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    per_token, low, high = objective(ratio, adv, torch.where(valid, logps, zero), settings)
    if settings.off_policy_mask_threshold is not None:
        sampling = batch.sampling_logps if batch.sampling_logps is not None else old
        per_token = per_token * off_policy_sequence_mask(
            adv, logps, torch.where(valid, sampling, zero), valid, settings.off_policy_mask_threshold)
    selection = None if batch.selection is None else batch.selection.detach().to(logps.dtype)
    if selection is not None:
        per_token = per_token * selection
    if batch.weights is not None:
        weights = batch.weights.detach().to(logps.dtype)
        per_token = per_token * (weights.unsqueeze(-1) if weights.dim() == 1 else weights)

    stat_dtype = torch.promote_types(logps.dtype, torch.float32)
    kl_sum = torch.zeros((), dtype=stat_dtype, device=logps.device)
    if batch.ref_logps is not None:
        kl = KL_ESTIMATORS.get(settings.kl_estimator)(
            torch.where(valid, logps, zero), torch.where(valid, batch.ref_logps, zero)
        )
        if settings.use_bias_correction_kl:
            kl = kl * ratio
        if settings.beta > 0:
            per_token = per_token + settings.beta * kl
        kl_sum = (kl.detach() * m).sum().to(stat_dtype)
    entropy_sum = torch.zeros((), dtype=stat_dtype, device=logps.device)
    if batch.entropies is not None:  # the bonus itself is added by policy_loss (entropy_bonus)
        entropy_sum = torch.where(valid, batch.entropies, zero).detach().sum().to(stat_dtype)

    per_token = torch.where(valid, per_token, zero)
    low, high = low & valid, high & valid
    stats = {
        "clipped_low": low.sum().to(stat_dtype),
        "clipped_high": high.sum().to(stat_dtype),
        "clipped_region": (low | high).sum().to(stat_dtype),
        "kl_sum": kl_sum,
        "entropy_sum": entropy_sum,
        "ratio_sum": (ratio.detach() * m).sum().to(stat_dtype),
        "token_count": valid.sum().to(stat_dtype),
    }
    return per_token, stats


def _normaliser_or_local(batch: PolicyLossBatch, normaliser: LossNormaliser | None) -> LossNormaliser:
    return LossNormaliser.for_step(batch.mask) if normaliser is None else normaliser


def _sequence_mean(per_token: Tensor, batch: PolicyLossBatch, norm: LossNormaliser) -> Tensor:
    seq_len = batch.mask.to(per_token.dtype).sum(-1).clamp(min=1)
    return (per_token.sum(-1) / seq_len).sum() / _at_least_one(norm.num_sequences)


@POLICY_LOSSES.register("grpo")
def grpo_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, normaliser: LossNormaliser | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """DeepSeekMath GRPO: mean over sequences of each sequence's token-mean loss."""
    per_token, stats = per_token_policy_loss(batch, settings)
    return _sequence_mean(per_token, batch, _normaliser_or_local(batch, normaliser)), stats


@POLICY_LOSSES.register("bnpo")
def bnpo_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, normaliser: LossNormaliser | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """BNPO: token mean over the optimizer step's valid tokens (this rank)."""
    per_token, stats = per_token_policy_loss(batch, settings)
    norm = _normaliser_or_local(batch, normaliser)
    return per_token.sum() / _at_least_one(norm.num_tokens), stats


@POLICY_LOSSES.register("dr_grpo")
def dr_grpo_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, normaliser: LossNormaliser | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr. GRPO: token sum / (num_sequences × max_completion_length), no length bias."""
    if settings.max_completion_length is None:
        raise ConfigError("loss_type='dr_grpo' needs max_completion_length in the loss settings")
    per_token, stats = per_token_policy_loss(batch, settings)
    norm = _normaliser_or_local(batch, normaliser)
    denom = _at_least_one(norm.num_sequences) * settings.max_completion_length
    return per_token.sum() / denom, stats


@POLICY_LOSSES.register("dapo")
def dapo_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, normaliser: LossNormaliser | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO: token sum / mean valid tokens per optimizer step over the generation batch (per rank)."""
    per_token, stats = per_token_policy_loss(batch, settings)
    norm = _normaliser_or_local(batch, normaliser)
    return per_token.sum() / _at_least_one(norm.num_tokens_per_step_global), stats


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, normaliser: LossNormaliser | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): clipped, detached IS weight × A × log π_θ, aggregated like ``dapo`` (as TRL).

    The cap is ``epsilon_high``, or ``epsilon`` when that is unset (TRL's fallback; ScaleRL uses 5.0)."""
    per_token, stats = per_token_policy_loss(batch, settings, cispo_objective)
    norm = _normaliser_or_local(batch, normaliser)
    return per_token.sum() / _at_least_one(norm.num_tokens_per_step_global), stats


@POLICY_LOSSES.register("sapo")
def sapo_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, normaliser: LossNormaliser | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (soft adaptive policy optimization): soft-gated ratio, aggregated like ``grpo`` (as TRL)."""
    per_token, stats = per_token_policy_loss(batch, settings, sapo_objective)
    return _sequence_mean(per_token, batch, _normaliser_or_local(batch, normaliser)), stats


@POLICY_LOSSES.register("luspo")
def luspo_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, normaliser: LossNormaliser | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """LUSPO: the clipped objective, each sequence's token *sum*, averaged over sequences (as TRL)."""
    per_token, stats = per_token_policy_loss(batch, settings)
    return per_token.sum() / _at_least_one(_normaliser_or_local(batch, normaliser).num_sequences), stats


def vespo_gamma_weights(batch: PolicyLossBatch, settings: PolicyLossSettings) -> Tensor:
    """VESPO's per-sequence gradient scale φ(w) = e^λ · w^k · e^(−λw) (φ(1) = 1), detached, [B, 1].

    w = Π_t r_it · c_it over the sequence's valid tokens, r the ratio to the old policy and c the
    per-token importance-sampling correction weights (``batch.weights``), computed in log space with
    TRL 1.16's clamps (each log r to [−20, 20], each log c and log w to [log 1e-8, 20]); k, λ are the
    ``vespo_*_pos`` values where A >= 0, the ``vespo_*_neg`` ones elsewhere; NaN/inf φ become 0.
    """
    logps = batch.logps.detach()
    valid = batch.mask.bool()
    m = valid.to(logps.dtype)
    zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
    old = logps if batch.old_logps is None else batch.old_logps
    floor = math.log(1e-8)
    log_ratio = torch.where(valid, logps - old, zero).clamp(-20.0, 20.0)
    log_w = (log_ratio * m).sum(-1, keepdim=True)
    if batch.weights is not None:
        if batch.weights.dim() != 2:
            raise ConfigError("loss_type='vespo' takes per-token importance-sampling weights only: use "
                              "importance_sampling_mode 'token_truncate' or 'token_mask' (as TRL)")
        log_c = torch.log(batch.weights.detach().to(logps.dtype)).clamp(floor, 20.0)
        log_w = log_w + torch.where(valid, log_c, zero).sum(-1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    adv = batch.advantages.to(logps.dtype)
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    nonneg = adv >= 0
    k = torch.where(nonneg, settings.vespo_k_pos, settings.vespo_k_neg).to(logps.dtype)
    lam = torch.where(nonneg, settings.vespo_lambda_pos, settings.vespo_lambda_neg).to(logps.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@POLICY_LOSSES.register("vespo")
def vespo_loss(
    batch: PolicyLossBatch, settings: PolicyLossSettings, normaliser: LossNormaliser | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO: −sg[φ(w)]·A·log π_θ with φ the gamma weight of the sequence ratio, aggregated like ``dapo``.

    The importance-sampling correction weights enter φ (not the product), so they are taken off the batch."""
    phi = vespo_gamma_weights(batch, settings)

    def objective(ratio: Tensor, adv: Tensor, logps: Tensor, _: PolicyLossSettings) -> tuple[Tensor, Tensor, Tensor]:
        none = torch.zeros(ratio.shape, dtype=torch.bool, device=ratio.device)
        return -phi * adv * logps, none, none

    per_token, stats = per_token_policy_loss(dataclasses.replace(batch, weights=None), settings, objective)
    norm = _normaliser_or_local(batch, normaliser)
    return per_token.sum() / _at_least_one(norm.num_tokens_per_step_global), stats


def policy_loss(
    loss_type: str,
    batch: PolicyLossBatch,
    settings: PolicyLossSettings,
    normaliser: LossNormaliser | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss registered as ``loss_type``, minus the entropy bonus (:func:`entropy_bonus`); ``normaliser=None``
    treats the micro-batch as the whole step."""
    loss, stats = POLICY_LOSSES.get(loss_type)(batch, settings, normaliser)
    if settings.entropy_coef != 0:
        loss = loss - settings.entropy_coef * entropy_bonus(batch, _normaliser_or_local(batch, normaliser))
    return loss, stats


def entropy_bonus(batch: PolicyLossBatch, normaliser: LossNormaliser) -> Tensor:
    """This micro-batch's share of the step's mean per-token entropy H (``L = L_policy − entropy_coef·H``, TRL's
    objective): the same whatever ``loss_type`` normalises the policy term by. Tokens outside ``batch.selection``
    (``top_entropy_quantile``) add nothing and still count in the mean's denominator."""
    if batch.entropies is None:
        raise DataError("an entropy bonus needs per-token entropies")
    valid = batch.mask.bool()
    ent = torch.where(valid, batch.entropies, torch.zeros((), dtype=batch.entropies.dtype, device=valid.device))
    if batch.selection is not None:
        ent = ent * batch.selection.detach().to(ent.dtype)
    return ent.sum() / _at_least_one(normaliser.num_tokens)


def ppo_policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cliprange: float = 0.2,
    normaliser: LossNormaliser | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped policy loss: the token-level ``bnpo`` loss with per-token advantages [B, T]."""
    batch = PolicyLossBatch(logps=logps, advantages=advantages, mask=mask, old_logps=old_logps)
    return bnpo_loss(batch, PolicyLossSettings(epsilon=cliprange), normaliser)


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float = 0.2,
    normaliser: LossNormaliser | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss Σ 0.5·max((v−R)², (clip(v, v_old±c)−R)²)·m / num_tokens.

    Same convention as the policy losses: divided by the optimizer step's ``num_tokens``
    (the micro-batch's own count when ``normaliser`` is None). Stats: value_clipped (tokens where
    the clipped branch is the larger), token_count (sums) and clip_fraction (this micro-batch).
    """
    if not cliprange_value >= 0:
        raise ConfigError(f"cliprange_value must be >= 0, got {cliprange_value!r}")
    for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if t.shape != values.shape:
            raise DataError(f"{name} has shape {tuple(t.shape)}, expected {tuple(values.shape)} like values")
    valid = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    per_token = torch.where(valid, 0.5 * torch.maximum(loss_unclipped, loss_clipped), zero)
    num_tokens = mask.sum() if normaliser is None else normaliser.num_tokens
    loss = per_token.sum() / _at_least_one(num_tokens)

    stat_dtype = torch.promote_types(values.dtype, torch.float32)
    clipped = ((loss_clipped > loss_unclipped) & valid).sum().to(stat_dtype)
    count = valid.sum().to(stat_dtype)
    stats = {"value_clipped": clipped, "token_count": count, "clip_fraction": clipped / count.clamp(min=1)}
    return loss, stats
