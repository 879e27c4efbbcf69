"""Vectorised generalised advantage estimation (GAE) and masked whitening.

GAE is the discounted reverse cumulative sum A_t = δ_t + γλ·c_t·A_{t+1} of the TD errors δ.
Instead of a Python loop over time steps it is computed with matrix products
(:func:`discounted_reverse_cumsum`): the sequence is cut into chunks of C steps; inside a chunk
y = W·x with W[t, k] = d^(k−t)·[k ≥ t]·[no stop in t..k−1] (the power is taken directly, so a
small discount underflows cleanly to 0 instead of going through a cumulative product that over-
or underflows); the chunk-start values then obey the same recurrence with discount d^C over
T/C steps, solved recursively, and are carried back into every chunk. Cost O(R·T·C) time and
memory for R rows of length T (recursion depth log_C T), versus O(R·T²) for one dense [T, T]
matrix; with no stops the chunk matrix is shared by all rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from grpo_ascend.errors import ConfigError, DataError

DEFAULT_CHUNK = 64


def _check_coefficients(gamma: float, lam: float) -> None:
    if not 0 <= gamma <= 1:
        raise ConfigError(f"gamma must be in [0, 1], got {gamma!r}")
    if not 0 <= lam <= 1:
        raise ConfigError(f"lam must be in [0, 1], got {lam!r}")


def _powers(discount: float, size: int, like: Tensor) -> Tensor:
    """[size, size] matrix with discount^(k−t) on and above the diagonal (t row, k column), 0 below."""
    idx = torch.arange(size, device=like.device)
    exponent = (idx.unsqueeze(0) - idx.unsqueeze(1)).to(like.dtype)
    base = torch.tensor(discount, dtype=like.dtype, device=like.device)
    upper = exponent >= 0
    # 0^0 = 1 in torch.pow, which is what the diagonal needs when the discount is 0.
    return torch.where(
        upper, torch.pow(base, exponent.clamp(min=0)), torch.zeros((), dtype=like.dtype, device=like.device)
    )


def _dense(x: Tensor, discount: float, stops: Tensor | None) -> Tensor:
    """Reverse discounted cumsum along the last dim with one [C, C] (or per-row) matrix."""
    size = x.shape[-1]
    w = _powers(discount, size, x)
    if stops is None:
        return x @ w.transpose(0, 1)
    # seg[t] = stops before t; x_k reaches y_t only if no stop lies in t..k−1, i.e. seg[k] == seg[t].
    seg = torch.cumsum(stops.to(torch.int64), dim=-1) - stops.to(torch.int64)
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)
    w_rows = torch.where(same, w, torch.zeros((), dtype=x.dtype, device=x.device))
    return (w_rows @ x.unsqueeze(-1)).squeeze(-1)


def discounted_reverse_cumsum(
    x: Tensor, discount: float, stops: Tensor | None = None, chunk_size: int = DEFAULT_CHUNK
) -> Tensor:
    """y_t = x_t + discount·(1 − stops_t)·y_{t+1} along the last dim, with y_T = 0.

    ``stops`` (bool/0-1, same shape as x) cuts the recursion after step t (episode ends).
    """
    if chunk_size < 2:
        raise ConfigError(f"chunk_size must be >= 2 (each recursion level shrinks T by it), got {chunk_size}")
    if stops is not None and stops.shape != x.shape:
        raise DataError(f"stops has shape {tuple(stops.shape)}, expected {tuple(x.shape)}")
    length = x.shape[-1]
    if length <= chunk_size:
        return _dense(x, discount, stops)

    num_chunks = -(-length // chunk_size)
    pad = num_chunks * chunk_size - length
    lead = x.shape[:-1]
    xc = torch.nn.functional.pad(x, (0, pad)).reshape(*lead, num_chunks, chunk_size)
    sc = None
    if stops is not None:
        sc = torch.nn.functional.pad(stops.to(torch.int64), (0, pad)).reshape(*lead, num_chunks, chunk_size)
    local = _dense(xc, discount, sc)

    # Weight linking position i of a chunk to the first step of the next chunk: d^(C−i), zeroed
    # when a stop lies in i..C−1.
    i = torch.arange(chunk_size, device=x.device)
    base = torch.tensor(discount, dtype=x.dtype, device=x.device)
    link = torch.pow(base, (chunk_size - i).to(x.dtype)).expand(*lead, num_chunks, chunk_size)
    chunk_stop = None
    if sc is not None:
        stops_to_end = torch.flip(torch.cumsum(torch.flip(sc, (-1,)), -1), (-1,))
        link = torch.where(stops_to_end == 0, link, torch.zeros((), dtype=x.dtype, device=x.device))
        chunk_stop = stops_to_end[..., 0] > 0

    # Chunk starts obey the same recurrence over chunks with discount d^C.
    starts = discounted_reverse_cumsum(local[..., 0], discount**chunk_size, chunk_stop, chunk_size)
    next_start = torch.nn.functional.pad(starts[..., 1:], (0, 1))
    y = local + link * next_start.unsqueeze(-1)
    return y.reshape(*lead, num_chunks * chunk_size)[..., :length]


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """GAE for right-padded LM batches [B, T]; returns (advantages, returns), zero at masked tokens.

    Each row is one episode over its contiguous valid tokens; the value after the last valid
    token is 0 (the episode ends there). Rewards/values at masked positions are ignored.
    """
    _check_coefficients(gamma, lam)
    for name, t in (("values", values), ("mask", mask)):
        if t.shape != rewards.shape:
            raise DataError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(rewards.shape)} like rewards"
            )
    if rewards.dim() != 2:
        raise DataError(f"rewards must be [B, T], got shape {tuple(rewards.shape)}")
    m = mask.to(rewards.dtype)
    v = values.to(rewards.dtype) * m
    r = rewards * m
    next_v = torch.nn.functional.pad(v[:, 1:], (0, 1))
    delta = (r + gamma * next_v - v) * m
    adv = discounted_reverse_cumsum(delta, gamma * lam) * m
    return adv, (adv + v) * m


def gae_advantages_env(
    rewards: Tensor,
    values: Tensor,
    dones: Tensor,
    next_value: Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """GAE for environment rollouts [T, N] (time first); returns (advantages, returns) [T, N].

    ``dones[t, n]`` = 1 when the transition at step t ended env n's episode: no bootstrap from
    values[t+1] and the advantage recursion restarts. ``next_value`` [N] is the value of the
    observation after the last step (bootstrap for unfinished episodes). Truncations are treated
    as terminations; fold γ·V(final obs) into the reward to bootstrap them.
    """
    _check_coefficients(gamma, lam)
    if rewards.dim() != 2:
        raise DataError(f"rewards must be [T, N], got shape {tuple(rewards.shape)}")
    for name, t in (("values", values), ("dones", dones)):
        if t.shape != rewards.shape:
            raise DataError(
                f"{name} has shape {tuple(t.shape)}, expected {tuple(rewards.shape)} like rewards"
            )
    if next_value.shape != rewards.shape[1:]:
        raise DataError(f"next_value must be [N] = {tuple(rewards.shape[1:])}, got {tuple(next_value.shape)}")
    r = rewards.transpose(0, 1)
    v = values.to(r.dtype).transpose(0, 1)
    d = dones.bool().transpose(0, 1)
    next_v = torch.cat([v[:, 1:], next_value.to(r.dtype).unsqueeze(-1)], dim=-1)
    delta = r + gamma * next_v * (~d).to(r.dtype) - v
    adv = discounted_reverse_cumsum(delta, gamma * lam, stops=d)
    return adv.transpose(0, 1), (adv + v).transpose(0, 1)


def whiten(x: Tensor, mask: Tensor | None = None, shift_mean: bool = True, eps: float = 1e-8,
           reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """(x − mean) / sqrt(var + eps) over valid entries (unbiased var); masked entries become 0.

    ``shift_mean=False`` adds the mean back (scale only), as TRL does for rewards. ``reduce``: a sum
    all-reduce over ranks (e.g. ``Ranks.reduce``), so the statistics cover every rank's valid entries.
    """
    if mask is None:
        mask = torch.ones_like(x, dtype=torch.bool)
    if mask.shape != x.shape:
        raise DataError(f"mask has shape {tuple(mask.shape)}, expected {tuple(x.shape)} like x")
    m = mask.to(x.dtype)
    sums = torch.stack([(x * m).sum(), m.sum()])
    if reduce is not None:
        sums = reduce(sums)
    n = sums[1]
    mean = sums[0] / n.clamp(min=1)
    squares = (((x - mean) ** 2) * m).sum()
    if reduce is not None:
        squares = reduce(squares)
    var = squares / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m
