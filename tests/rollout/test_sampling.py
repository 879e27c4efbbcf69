"""Sampling kernels: exact categorical draws and exact log-probs on every path (fast, race, filtered)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_ascend.rollout import sampling
from grpo_ascend.rollout.sampling import SamplingParams, next_tokens, sample_categorical, sample_with_logprob


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square over cells with expected count >= 5, accepted at ~5 null standard deviations."""
    expected = probs * counts.sum()
    big = expected >= 5
    stat = (((counts[big] - expected[big]) ** 2) / expected[big]).sum().item()
    dof = int(big.sum()) - 1
    return stat < dof + 5 * math.sqrt(2 * dof)


LOGITS = torch.tensor([-math.inf, 2.0, 1.5, -math.inf, 1.0, 0.0, -1.0, -3.0, -math.inf])


@pytest.fixture(params=["inverse_cdf", "chunked", "exponential_race"])
def draw_path(request, monkeypatch):
    """Run a test on the float64 inverse-CDF path, on its vocabulary-chunked form (chunks of 2 here:
    one of them all -inf, the last one partial) and on the race kept for devices without float64."""
    if request.param == "exponential_race":
        monkeypatch.setattr(sampling, "float64_supported", lambda device: False)
    if request.param == "chunked":
        monkeypatch.setattr(sampling, "CHUNK_ELEMENTS", 2)
        monkeypatch.setattr(sampling, "MIN_CHUNK_WIDTH", 2)
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_plain_sampling_draws_softmax_and_reports_exact_logprobs(draw_path, temperature):
    logits = LOGITS.repeat(60_000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, lps = sample_with_logprob(logits, temperature, gen)
    probs = torch.softmax(LOGITS.double() / temperature, 0)
    counts = torch.bincount(tokens, minlength=LOGITS.numel()).double()
    assert counts[probs == 0].sum() == 0, "drew a token of probability zero"
    assert chi_square_ok(counts, probs)
    wrong = torch.softmax(LOGITS.double() / (temperature * 1.3), 0)
    assert not chi_square_ok(counts, wrong)  # the test has the power to see a wrong temperature
    assert lps.dtype == torch.float32
    torch.testing.assert_close(lps.double(), probs.log()[tokens], atol=1e-6, rtol=0)


def test_sample_categorical_matches_softmax(draw_path):
    logits = LOGITS.repeat(60_000, 1)
    tokens = sample_categorical(logits, torch.Generator().manual_seed(1))
    probs = torch.softmax(LOGITS.double(), 0)
    counts = torch.bincount(tokens, minlength=LOGITS.numel()).double()
    assert counts[probs == 0].sum() == 0
    assert chi_square_ok(counts, probs)


def test_plain_sampling_is_exact_at_a_real_vocabulary():
    """Qwen2.5's 151,936 tokens: log-probs match a float64 log_softmax; a token of mass 1/2 is drawn half the time."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 151_936, generator=gen) * 4
    logits[:, 123_456] = torch.logsumexp(logits.double(), -1).float()  # about half the mass
    logits = logits.bfloat16().float()
    tokens, lps = sample_with_logprob(logits, 1.0, gen)
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(lps.double(), ref.gather(1, tokens[:, None]).squeeze(1), atol=2e-5, rtol=0)
    share = ref[:, 123_456].exp().mean().item()
    assert abs((tokens == 123_456).double().mean().item() - share) < 5 * math.sqrt(share * (1 - share) / 256)


def test_inverse_cdf_never_draws_zero_weights_at_the_edges():
    """u is kept below the total: a uniform at (or rounding to) 1 cannot fall past the last positive weight."""
    weights = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0], [1e-30, 0.0, 0.0, 0.0, 0.0]])

    gen = torch.Generator().manual_seed(0)
    real_rand = torch.rand
    try:
        torch.rand = lambda *a, **k: torch.full(a[0], 1.0, dtype=k["dtype"])  # the worst draw
        tokens, total = sampling.draw_by_inverse_cdf(weights, gen)
        torch.rand = lambda *a, **k: torch.zeros(a[0], dtype=k["dtype"])  # and the other end
        low, _ = sampling.draw_by_inverse_cdf(weights, gen)
    finally:
        torch.rand = real_rand
    assert tokens.tolist() == [2, 0] and low.tolist() == [2, 0]
    torch.testing.assert_close(total, torch.tensor([3.0, 1e-30], dtype=torch.float64))


def test_next_tokens_takes_the_fast_path_only_for_plain_settings(monkeypatch):
    calls = []
    real = sampling.sample_with_logprob
    monkeypatch.setattr(sampling, "sample_with_logprob", lambda *a: calls.append(1) or real(*a))
    logits = torch.randn(4, 50)
    seen = torch.zeros(4, 50, dtype=torch.bool)
    for params, fast in [
        (SamplingParams(), True),
        (SamplingParams(temperature=0.5), True),
        (SamplingParams(repetition_penalty=1.0), True),
        (SamplingParams(top_p=0.9), False),
        (SamplingParams(top_k=5), False),
        (SamplingParams(min_p=0.1), False),
        (SamplingParams(repetition_penalty=1.2), False),
        (SamplingParams(temperature=0), False),
    ]:
        calls.clear()
        tokens, lps = next_tokens(logits, params, seen, torch.Generator().manual_seed(0))
        assert bool(calls) == fast, params
        scaled = logits / params.logprob_temperature
        torch.testing.assert_close(lps, torch.log_softmax(scaled, -1).gather(1, tokens[:, None]).squeeze(1))
    greedy = next_tokens(logits, SamplingParams(temperature=0))[0]
    assert torch.equal(greedy, logits.argmax(-1))
