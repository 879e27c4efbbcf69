"""Chunked log-probs/entropies equal the naive full-vocabulary computation and save less memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.models.logprobs import (
    logits_to_logprobs,
    token_logprobs_from_hidden,
    token_logprobs_from_logits,
)


def naive(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def setup(batch=3, length=11, width=16, vocab=97, bias=True, seed=0):
    torch.manual_seed(seed)
    head = nn.Linear(width, vocab, bias=bias)
    hidden = torch.randn(batch, length, width) * 2
    targets = torch.randint(0, vocab, (batch, length))
    return head, hidden, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 33, 512])
def test_hidden_values_and_gradients_match_naive(temperature, chunk_size):
    head, hidden, targets = setup()
    weights = torch.randn(3, 11)

    h1 = hidden.clone().requires_grad_(True)
    logp, ent = token_logprobs_from_hidden(h1, head, targets, temperature, chunk_size, with_entropy=True)
    ((logp * weights).sum() + (ent * weights.flip(0)).sum()).backward()
    g_h1, g_w1, g_b1 = h1.grad, head.weight.grad.clone(), head.bias.grad.clone()
    head.zero_grad()

    h2 = hidden.clone().requires_grad_(True)
    ref_logp, ref_ent = naive(head(h2), targets, temperature)
    ((ref_logp * weights).sum() + (ref_ent * weights.flip(0)).sum()).backward()

    assert logp.dtype == torch.float32 and logp.shape == (3, 11)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_h1, h2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_w1, head.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_b1, head.bias.grad, rtol=1e-5, atol=1e-5)


def test_without_entropy_and_under_no_grad():
    head, hidden, targets = setup(bias=False)
    with torch.no_grad():
        logp, ent = token_logprobs_from_hidden(hidden, head, targets, chunk_size=4)
        ref, _ = naive(head(hidden), targets)
    assert ent is None and not logp.requires_grad
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)


def test_bf16_hidden_is_reduced_in_float32():
    head, hidden, targets = setup()
    head = head.to(torch.bfloat16)
    hb = hidden.to(torch.bfloat16)
    logp, ent = token_logprobs_from_hidden(hb, head, targets, chunk_size=8, with_entropy=True)
    ref_logp, ref_ent = naive(head(hb).float(), targets)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [4, 512])
def test_logits_path_matches_naive(chunk_size):
    head, hidden, targets = setup()
    logits = head(hidden).detach()
    l1 = logits.clone().requires_grad_(True)
    logp, ent = token_logprobs_from_logits(l1, targets, 0.8, chunk_size, with_entropy=True)
    (logp.sum() + 0.3 * ent.sum()).backward()
    l2 = logits.clone().requires_grad_(True)
    ref_logp, ref_ent = naive(l2, targets, 0.8)
    (ref_logp.sum() + 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l1.grad, l2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits_to_logprobs(logits, targets, 0.8), ref_logp, rtol=1e-5, atol=1e-5)


def _saved_bytes(fn) -> int:
    """Bytes of distinct tensors autograd saves for the backward while ``fn`` runs."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return sum(seen.values())


def test_chunked_checkpoint_does_not_keep_full_vocab_logits():
    vocab, tokens = 32_000, 2 * 64
    head, hidden, targets = setup(batch=2, length=64, width=32, vocab=vocab, bias=False)
    hidden.requires_grad_(True)
    full_logits_bytes = tokens * vocab * 4

    naive_bytes = _saved_bytes(lambda: naive(head(hidden), targets)[0].sum())
    chunked_bytes = _saved_bytes(
        lambda: token_logprobs_from_hidden(hidden, head, targets, chunk_size=16, with_entropy=True)[0].sum()
    )
    assert naive_bytes >= full_logits_bytes
    # Only hidden chunks, targets and per-token outputs survive: far below one chunk of logits.
    assert 0 < chunked_bytes < 16 * vocab * 4
    assert chunked_bytes * 50 < naive_bytes


def test_errors():
    head, hidden, targets = setup()
    with pytest.raises(ConfigError, match="temperature"):
        token_logprobs_from_hidden(hidden, head, targets, temperature=0.0)
    with pytest.raises(ConfigError, match="chunk_size"):
        token_logprobs_from_hidden(hidden, head, targets, chunk_size=0)
    with pytest.raises(DataError, match="targets has shape"):
        token_logprobs_from_hidden(hidden, head, targets[:, :-1])
    with pytest.raises(DataError, match="integer"):
        token_logprobs_from_logits(head(hidden), targets.float())
    with pytest.raises(DataError, match=r"\[B, T, H\]"):
        token_logprobs_from_hidden(hidden[0], head, targets)


def _is_vocab_tensor(o, vocab: int) -> bool:
    try:
        return isinstance(o, torch.Tensor) and o.dim() == 2 and o.shape[1] == vocab
    except ReferenceError:  # a weakref proxy whose object is gone (an earlier test's, in the same process)
        return False


def _vocab_tensors_alive(vocab: int) -> int:
    import gc
    import warnings

    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if _is_vocab_tensor(o, vocab))


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_entropy_without_grad_keeps_no_vocabulary_tensor_after_backward(entropy_grad):
    """The trainers keep the entropies alive (detached into the loss stats) through the backward.
    With a gradient path, the checkpointed chunks' recomputed softmax/product for the entropy are
    never consumed and stay alive with the graph: 3 [chunk, V] tensors per chunk (2.6 GiB at
    Qwen2.5's vocabulary, 8 x 256 tokens). ``entropy_grad=False`` must keep none, same values."""
    torch.manual_seed(0)
    vocab, chunk = 1031, 8
    head = nn.Linear(16, vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(2, 20, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (2, 20))
    logps, entropies = token_logprobs_from_hidden(hidden, head, targets, chunk_size=chunk, with_entropy=True,
                                                  entropy_grad=entropy_grad)
    logps.sum().backward()
    alive = _vocab_tensors_alive(vocab)
    ref_logps, ref_ent = token_logprobs_from_hidden(hidden.detach(), head, targets, chunk_size=chunk, with_entropy=True)
    torch.testing.assert_close(logps.detach(), ref_logps)
    torch.testing.assert_close(entropies.detach(), ref_ent)
    assert entropies.requires_grad is entropy_grad
    if entropy_grad:
        assert alive == 3 * 5  # the mechanism this guards against (40 rows / chunks of 8)
    else:
        assert alive == 0
