"""Per-token log-probs (and entropies) of chosen tokens without a full-vocabulary float32 tensor.

A naive ``log_softmax(lm_head(hidden).float()).gather(...)`` materialises a [B, T, V] float32
tensor (≈ 4.9 GB for B·T = 8k tokens and a 150k vocabulary) and autograd keeps it for the
backward. Here the B·T tokens are processed in chunks of ``chunk_size``: each chunk's logits are
projected, upcast to float32, reduced to one log-prob (and entropy) per token and dropped. When
grad is enabled each chunk runs under ``torch.utils.checkpoint`` so the backward recomputes the
chunk's logits instead of storing them: the saved state is the hidden chunk, not [chunk, V].
Peak extra memory is then about ``chunk_size × V × 4 bytes × a few`` instead of ``B·T × V × 4``.

Alignment: ``targets[b, t]`` is the token whose probability is read from position t (the caller
does the causal shift). Targets must be valid ids in [0, V): replace padding/ignore ids (e.g.
-100) by any valid id and mask those positions out downstream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpo_ascend.errors import ConfigError, DataError

DEFAULT_CHUNK_SIZE = 512


def _check(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature!r}")
    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be >= 1, got {chunk_size!r}")


def _logprob_entropy(
    logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """float32 log-prob of ``targets`` [N] and entropy [N] from logits [N, V].

    ``entropy_grad=False`` computes the entropy outside autograd: under the chunk's checkpoint its
    softmax and product would otherwise be recomputed in the backward and, never consumed, stay
    alive with the graph (three [N, V] float32 tensors per chunk, the whole micro-batch's vocabulary).
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


def _chunked(
    fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    source: Tensor,
    targets: Tensor,
    chunk_size: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """Apply ``fn`` to row chunks of ``source`` [N, ...] / ``targets`` [N], checkpointed under grad."""
    use_checkpoint = torch.is_grad_enabled()
    logps, ents = [], []
    for start in range(0, source.shape[0], chunk_size):
        s = source[start : start + chunk_size]
        t = targets[start : start + chunk_size]
        if use_checkpoint:
            # No randomness inside, so skip stashing/restoring the RNG state for the recompute.
            lp, ent = checkpoint(fn, s, t, use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = fn(s, t)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps) if logps else source.new_zeros(0, dtype=torch.float32)
    if not with_entropy:
        return logp, None
    return logp, (torch.cat(ents) if ents else torch.zeros_like(logp))


def _check_targets(targets: Tensor, leading: torch.Size, what: str) -> None:
    if targets.shape != leading:
        raise DataError(
            f"targets has shape {tuple(targets.shape)}, expected {tuple(leading)} matching {what}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise DataError(f"targets must be integer token ids, got dtype {targets.dtype}")


def token_logprobs_from_hidden(
    hidden: Tensor,
    lm_head: nn.Module,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [B, T] (float32) of ``targets`` from last hidden states [B, T, H] and the LM head.

    The projection runs in the head's own dtype (no float32 copy of the V×H weight); softmax,
    log-sum-exp and entropy run in float32 per chunk. ``temperature`` divides the logits.
    ``entropy_grad=False``: the entropies carry no gradient (a loss without an entropy term), and
    the backward keeps no full-vocabulary tensor for them (see :func:`_logprob_entropy`).
    Returns (logps, entropies or None).
    """
    _check(temperature, chunk_size)
    if hidden.dim() != 3:
        raise DataError(f"hidden must be [B, T, H], got shape {tuple(hidden.shape)}")
    _check_targets(targets, hidden.shape[:2], "hidden [B, T]")
    batch, length, width = hidden.shape
    targets = targets.long()

    def fn(h: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        return _logprob_entropy(lm_head(h), t, temperature, with_entropy, entropy_grad)

    logp, ent = _chunked(fn, hidden.reshape(-1, width), targets.reshape(-1), chunk_size, with_entropy)
    logp = logp.view(batch, length)
    return logp, None if ent is None else ent.view(batch, length)


def token_logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [B, T] (float32) of ``targets`` from logits [B, T, V], float32 only per chunk.

    Use when the model already returned logits (possibly bf16): no full float32 copy is made,
    and under grad the float32 chunk is recomputed in the backward rather than kept.
    """
    _check(temperature, chunk_size)
    if logits.dim() != 3:
        raise DataError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    _check_targets(targets, logits.shape[:2], "logits [B, T]")
    batch, length, vocab = logits.shape

    def fn(chunk: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        return _logprob_entropy(chunk, t, temperature, with_entropy)

    logp, ent = _chunked(fn, logits.reshape(-1, vocab), targets.long().reshape(-1), chunk_size, with_entropy)
    logp = logp.view(batch, length)
    return logp, None if ent is None else ent.view(batch, length)


def logits_to_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Just the log-probs [B, T] of ``targets`` from logits [B, T, V] (chunked, float32)."""
    return token_logprobs_from_logits(logits, targets, temperature)[0]
