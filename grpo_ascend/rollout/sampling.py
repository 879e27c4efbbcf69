"""Sampling settings and per-step logits processing for the rollout engine.

Two distributions are involved at every decode step and they are deliberately different:

* the **sampling distribution** the token is drawn from: raw logits → repetition penalty →
  ÷ temperature → top-k → top-p → min-p (the order Hugging Face ``generate`` applies them);
* the **reported log-probability** of the drawn token: ``log_softmax(raw_logits / T)`` with no
  penalty and no filtering. This is exactly what the trainer's teacher-forced forward computes
  for the old policy, so the importance ratio is exactly 1 at the first iteration. The price is
  that with top-k/top-p/min-p/repetition penalty the reported value is not the log-probability
  of the (filtered) proposal the token was actually drawn from; that is the convention TRL and
  verl use and the one the GRPO loss expects.

Temperature 0 means greedy decoding (argmax of the penalised logits); its log-probs are then
reported at T = 1. ``top_k == 1`` is greedy as well, with log-probs at the given temperature.

Drawing is inverse-CDF sampling with one uniform per row: the first token whose float64
cumulative weight exceeds ``u × total``. It is an exact categorical draw (float64 partial sums
over 150k tokens are off by ~1e-11), needs no host synchronisation, is reproducible from a
``torch.Generator``, and costs one random number per row instead of one per vocabulary entry
(a per-token exponential race or Gumbel noise costs more than the whole rest of the step on the
CPU). Devices without native float64 (see ``device.float64_supported``) keep the exponential race
(argmax of p / E with E ~ Exp(1)), also exact. For the default settings (no top-k/top-p/min-p, no
repetition penalty) :func:`sample_with_logprob` reads the logits from memory once: per
cache-sized vocabulary chunk a max, ``exp((x - max_c) / T)`` and its sum; the chunk totals give
the exact log-normaliser and pick the chunk, and an inverse CDF inside that chunk picks the token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpo_ascend.device import float64_supported
from grpo_ascend.errors import ConfigError

PROMPT_TRUNCATION_MODES = ("error", "left")


@dataclass
class SamplingParams:
    """What to sample: group size, lengths, the sampling distribution, stopping and seeding.

    Field names and meanings follow TRL's GRPOConfig / vLLM's SamplingParams. ``stop_strings``
    end a completion at the token that completes the string (that token counts, the string is cut
    from the decoded text); ``stop_token_ids`` end it at (and including) the token; the tokenizer's
    and the model's EOS always stop unless ``ignore_eos`` (benchmarks, fixed-length rollouts).
    ``length_bucket`` pads prompt and completion lengths to its multiples so an accelerator that
    compiles per shape sees few shapes (0 or 1 = exact lengths; None = the device's default,
    64 on NPU and exact elsewhere, see ``device.default_length_bucket``). ``seed`` reseeds every call
    (identical inputs give identical samples); for a reproducible stream that differs from step to
    step pass a persistent ``torch.Generator`` to ``RolloutEngine.generate`` instead.
    ``compile_decode`` runs the decode steps through a compiled model (``torch.compile`` on CPU and
    CUDA, the NPU's graph mode; see ``device.compile_for_decode``); None = the device's default
    (``device.default_compile_decode``). The prefill stays eager. ``shared_prefix`` lets a group's G
    completions read their prompt's keys/values once per decode step instead of once each
    (``rollout/shared_prefix.py``; same attention up to float rounding); None = the device's default
    (``device.default_shared_prefix_decode``: on the CPU, and not with a compiled decode). Models whose
    attention it does not reproduce (sliding windows, soft-capping) keep the plain cache.
    """

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop_strings: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    max_prompt_length: int | None = 512
    prompt_truncation: str = "error"
    length_bucket: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    compile_decode: bool | None = None
    shared_prefix: bool | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None  # for apply_chat_template on chat prompts

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic: temperature 0 or top_k 1."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution whose log-probs are reported (1.0 for greedy T = 0)."""
        return 1.0 if self.temperature == 0 else float(self.temperature)

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field, what is expected and how to fix it."""

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.num_generations) or self.num_generations < 1:
            raise ConfigError(f"num_generations must be an int >= 1, got {self.num_generations!r}")
        if not is_int(self.max_completion_length) or self.max_completion_length <= 0:
            raise ConfigError(
                f"max_completion_length must be an int >= 1, got {self.max_completion_length!r}; "
                "set it to the number of new tokens each completion may have"
            )
        if not is_num(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(
                f"top_p must be in (0, 1], got {self.top_p!r}; use 1.0 to disable nucleus filtering"
            )
        if not is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.min_p is not None and (not is_num(self.min_p) or not 0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be None or in [0, 1], got {self.min_p!r}")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty!r}")
        if isinstance(self.stop_strings, str):
            raise ConfigError(
                f"stop_strings must be a list of strings, got the string {self.stop_strings!r}; wrap it in a list"
            )
        for i, s in enumerate(self.stop_strings):
            if not isinstance(s, str) or not s:
                raise ConfigError(f"stop_strings[{i}] must be a non-empty string, got {s!r}")
        for i, t in enumerate(self.stop_token_ids):
            if not is_int(t) or t < 0:
                raise ConfigError(f"stop_token_ids[{i}] must be a non-negative int token id, got {t!r}")
        if self.max_prompt_length is not None and (
            not is_int(self.max_prompt_length) or self.max_prompt_length < 1
        ):
            raise ConfigError(
                f"max_prompt_length must be None or an int >= 1, got {self.max_prompt_length!r}"
            )
        if self.prompt_truncation not in PROMPT_TRUNCATION_MODES:
            raise ConfigError(
                f"prompt_truncation must be one of {PROMPT_TRUNCATION_MODES}, got {self.prompt_truncation!r}"
            )
        if self.length_bucket is not None and (not is_int(self.length_bucket) or self.length_bucket < 0):
            raise ConfigError(
                f"length_bucket must be None (device default) or an int >= 0 (0 or 1 = no bucketing), "
                f"got {self.length_bucket!r}"
            )
        if self.compile_decode is not None and not isinstance(self.compile_decode, bool):
            raise ConfigError(
                f"compile_decode must be None (device default), True or False, got {self.compile_decode!r}"
            )
        if self.shared_prefix is not None and not isinstance(self.shared_prefix, bool):
            raise ConfigError(
                f"shared_prefix must be None (device default), True or False, got {self.shared_prefix!r}"
            )
        if self.seed is not None and not is_int(self.seed):
            raise ConfigError(f"seed must be None or an int, got {self.seed!r}")


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL-style penalty (as in HF): seen tokens' positive logits ÷ penalty, negative ones × penalty.

    ``seen`` is a [B, V] bool mask of tokens present in the prompt or the completion so far.
    """
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalised, logits)


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float | None = None) -> Tensor:
    """Set to -inf the logits outside top-k, then outside the nucleus top-p, then below min_p × p_max.

    ``logits`` are already temperature-scaled, [B, V]. At least one token always survives.
    """
    vocab = logits.shape[-1]
    if top_k and top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None and min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def draw_by_inverse_cdf(weights: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """(one draw per row with probability ``weights / row sum``, the float64 row sums).

    ``weights`` [B, V] are non-negative with a positive row sum; zero-weight tokens are never drawn:
    the pick is the first index whose cumulative sum exceeds ``u`` with ``0 <= u < total``.
    """
    cdf = weights.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=weights.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u == total only by rounding
    return torch.searchsorted(cdf, u, right=True).squeeze(-1), total.squeeze(-1)


def sample_categorical(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row from softmax(logits); -inf logits are never drawn."""
    if float64_supported(logits.device):
        weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
        return draw_by_inverse_cdf(weights, generator)[0]
    probs = torch.softmax(logits, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return probs.div_(race).argmax(dim=-1)


CHUNK_ELEMENTS = 1 << 16  # logits per vocabulary chunk (all rows): 256 KiB of float32, cache-sized
MIN_CHUNK_WIDTH = 2048  # columns: fewer chunks cost more per-op overhead than the cache saves


def _chunk_width(rows: int, vocab: int) -> int:
    """Vocabulary columns per chunk of :func:`sample_with_logprob`."""
    return min(vocab, max(MIN_CHUNK_WIDTH, CHUNK_ELEMENTS // max(rows, 1)))


def sample_with_logprob(
    logits: Tensor, temperature: float, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """(tokens [B], float32 ``log_softmax(logits / T)`` at them) drawn from softmax(logits / T).

    The plain-sampling fast path. It reads the logits from memory once: the vocabulary is cut into
    cache-sized chunks, and each chunk's max, its weights ``exp((x - max_c) / T)`` and their sum
    are computed while the chunk is in the cache. The chunk totals rescaled to the row max (float64)
    give the normaliser (log-prob = ``(x_tok - max) / T - log(total)``) and, with one uniform per
    row, the chunk the token falls in; the draw then finishes by inverse CDF inside that one chunk
    (recomputed: 1/C of the row). A vocabulary of one chunk is drawn directly
    (:func:`draw_by_inverse_cdf`). Chunk sums are float32 (cascade summation over at most a few
    thousand terms: relative error ~1e-7, the size of float32 ``exp``'s own rounding); sums across
    chunks and inside the picked chunk are float64. The RNG use is unchanged: one float64 uniform per row.
    """
    inv_t = 1.0 / temperature
    logits = logits.float()  # a no-op for float32; mixed-dtype kernels are slower than this copy
    rows, vocab = logits.shape
    if not float64_supported(logits.device):
        return _race_with_logprob(logits, inv_t, generator)
    width = _chunk_width(rows, vocab)
    if width >= vocab:
        neg_peak = logits.amax(dim=-1, keepdim=True) * -inv_t
        weights = torch.add(neg_peak, logits, alpha=inv_t).exp_()
        tokens, total = draw_by_inverse_cdf(weights, generator)
        chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * inv_t + neg_peak.squeeze(-1)
        return tokens, chosen - total.log().float()
    return _chunked_with_logprob(logits, inv_t, width, generator)


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _chunked_with_logprob(
    logits: Tensor, inv_t: float, width: int, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """:func:`sample_with_logprob` over vocabulary chunks of ``width`` columns (float32 logits)."""
    rows, vocab = logits.shape
    n_chunks = -(-vocab // width)
    dev = logits.device
    neg_peaks = torch.empty((rows, n_chunks), dtype=torch.float32, device=dev)  # -max_c / T
    sums = torch.empty((rows, n_chunks), dtype=torch.float32, device=dev)
    buf = torch.empty((rows, width), dtype=torch.float32, device=dev)
    for c in range(n_chunks):
        chunk = logits[:, c * width : (c + 1) * width]
        out = buf[:, : chunk.shape[1]]
        neg = neg_peaks[:, c : c + 1]
        # an all -inf chunk gets a finite shift, so its weights are exp(-inf) = 0 rather than NaN
        torch.amax(chunk, dim=-1, keepdim=True, out=neg).mul_(-inv_t).clamp_max_(_FLOAT32_MAX)
        torch.add(neg, chunk, alpha=inv_t, out=out).exp_()
        torch.sum(out, dim=-1, out=sums[:, c])
    neg_peak = neg_peaks.amin(dim=-1, keepdim=True)  # -max / T of the whole row
    mass = sums.double() * (neg_peak - neg_peaks).double().exp_()  # chunk totals at the row's scale
    cum = mass.cumsum(-1)
    total = cum[:, -1:]
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=dev) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # u == total only by rounding
    pick = torch.searchsorted(cum, u, right=True).clamp_max_(n_chunks - 1)  # never a zero-mass chunk
    picked_mass = mass.gather(1, pick)
    frac = ((u - cum.gather(1, pick) + picked_mass) / picked_mass).clamp_(0.0, 1.0)
    # the picked chunk again, for every row: columns past the vocabulary get weight 0
    cols = pick * width + torch.arange(width, device=dev)
    inside = cols < vocab
    x = logits.gather(1, cols.clamp_max(vocab - 1))
    weights = torch.add(neg_peaks.gather(1, pick), x, alpha=inv_t).exp_().masked_fill_(~inside, 0.0)
    cdf = weights.cumsum(-1, dtype=torch.float64)
    last = cdf[:, -1:]
    target = torch.minimum(frac * last, torch.nextafter(last, torch.zeros_like(last)))
    within = torch.searchsorted(cdf, target, right=True)
    tokens = (pick * width + within).squeeze(-1)
    chosen = x.gather(1, within).squeeze(-1) * inv_t + neg_peak.squeeze(-1)
    return tokens, chosen - total.squeeze(-1).log().float()


def _race_with_logprob(
    logits: Tensor, inv_t: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Exponential race (argmax of p / E, E ~ Exp(1)) for devices without float64; exact as well."""
    neg_peak = logits.amax(dim=-1, keepdim=True) * -inv_t
    weights = torch.add(neg_peak, logits, alpha=inv_t).exp_()
    race = torch.empty_like(weights).exponential_(generator=generator).clamp_min_(torch.finfo(weights.dtype).tiny)
    tokens = (weights / race).argmax(dim=-1)
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * inv_t + neg_peak.squeeze(-1)
    return tokens, chosen - weights.sum(-1).log()


def plain_sampling(params: SamplingParams, seen: Tensor | None) -> bool:
    """True when nothing but the temperature shapes the sampling distribution (the default)."""
    return (
        not params.greedy
        and params.top_k == 0
        and params.top_p >= 1.0
        and not params.min_p
        and (seen is None or params.repetition_penalty == 1.0)
    )


def next_tokens(
    logits: Tensor,
    params: SamplingParams,
    seen: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Pick the next token per row and return (tokens [B] long, log-probs [B] float32).

    ``logits`` are the model's raw last-position logits [B, V] (any float dtype). The log-prob is
    ``log_softmax(logits / T)`` at the chosen token, unfiltered (see the module docstring).
    """
    if plain_sampling(params, seen):
        return sample_with_logprob(logits, params.temperature, generator)
    raw = logits.float()
    t_lp = params.logprob_temperature
    scaled = raw / t_lp if t_lp != 1.0 else raw
    work = raw
    if seen is not None and params.repetition_penalty != 1.0:
        work = apply_repetition_penalty(raw, seen, params.repetition_penalty)
    if params.greedy:
        tokens = work.argmax(dim=-1)
    else:
        work = work / params.temperature if params.temperature != 1.0 else work
        work = filter_logits(work, params.top_k, params.top_p, params.min_p)
        tokens = sample_categorical(work, generator)
    # gather − logsumexp: the log-prob without materialising a [B, V] log-softmax
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return tokens, chosen
