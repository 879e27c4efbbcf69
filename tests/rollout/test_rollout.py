"""Rollout engine: parity with generate, log-prob exactness, sampling statistics, masks, bad input."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.length_buckets import round_up
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.kv_cache import BucketedKVCache
from grpo_ascend.rollout.sampling import SamplingParams, filter_logits, next_tokens

PROMPTS = [
    "Hello world",
    "The cat sat on a long road and then the moon rose over the city",
    "What is 3 + 4?",
    "a",
]


def hf_greedy(model, tokenizer, prompts, max_new, **kwargs):
    enc = tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, **kwargs)
    return out[:, enc["input_ids"].shape[1] :]


def teacher_forced_logprobs(model, batch, temperature):
    """log softmax(logits / T) of the completion tokens from one full forward over prompt + completion."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    lp = batch.prompt_ids.shape[1]
    logits = logits[:, lp - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square with cells of expected count < 5 pooled; returns (statistic, dof)."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum().item()
    return stat, int(keep.sum().item()) - 1


def chi_square_ok(stat: float, dof: int) -> bool:
    """Accept at about 5 standard deviations of the chi-square null (false alarm << 1e-4)."""
    return stat < dof + 5 * math.sqrt(2 * dof)


# ---------------------------------------------------------------------------------------------
# greedy parity and exact log-probs


def test_greedy_matches_generate_token_for_token(chaotic):
    model, tok = chaotic
    ref = hf_greedy(model, tok, PROMPTS, 24)
    engine = RolloutEngine(model, tok)
    batch = engine.generate(
        PROMPTS, SamplingParams(num_generations=2, temperature=0, max_completion_length=24)
    )
    assert batch.completion_ids.shape == (8, 24)  # exact lengths: no bucketing by default off NPU
    assert torch.equal(batch.completion_ids[::2, :24], ref)
    assert torch.equal(batch.completion_ids[1::2], batch.completion_ids[::2])
    assert batch.completion_mask.sum().item() == 8 * 24
    assert batch.truncated.all()
    # top_k = 1 is greedy too, at any temperature
    topk1 = engine.generate(
        PROMPTS, SamplingParams(num_generations=1, temperature=0.7, top_k=1, max_completion_length=24)
    )
    assert torch.equal(topk1.completion_ids[:, :24], ref)


def test_greedy_parity_with_eos_and_padding(chaotic):
    model, tok = chaotic
    ref = hf_greedy(model, tok, PROMPTS, 20)
    eos = int(ref[1, 6])  # a token that row 1 emits at step 6 (other rows may emit it too)
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        ref = hf_greedy(model, tok, PROMPTS, 20, pad_token_id=tok.pad_token_id)
        batch = RolloutEngine(model, tok).generate(
            PROMPTS, SamplingParams(num_generations=1, temperature=0, max_completion_length=20)
        )
    finally:
        model.generation_config.eos_token_id = old
    width = ref.shape[1]
    assert torch.equal(batch.completion_ids[:, :width], ref)
    assert (batch.completion_ids[:, width:] == tok.pad_token_id).all()
    first = [row.tolist().index(eos) if eos in row.tolist() else None for row in ref]
    assert first[1] is not None and first[1] <= 6
    for i, f in enumerate(first):
        n = 20 if f is None else f + 1
        assert batch.completion_lengths[i].item() == n
        assert batch.completion_mask[i, :n].all() and not batch.completion_mask[i, n:].any()
        assert bool(batch.truncated[i]) == (f is None)


def test_repetition_penalty_matches_generate(chaotic):
    model, tok = chaotic
    prompts = ["a dog ran", "red blue green"]  # same token length: HF's input has no pad to penalise
    lens = {len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts}
    assert len(lens) == 1
    ref = hf_greedy(model, tok, prompts, 24, repetition_penalty=1.5)
    batch = RolloutEngine(model, tok).generate(
        prompts,
        SamplingParams(num_generations=1, temperature=0, repetition_penalty=1.5, max_completion_length=24),
    )
    assert torch.equal(batch.completion_ids[:, :24], ref)
    plain = hf_greedy(model, tok, prompts, 24)
    assert not torch.equal(plain, ref)  # the penalty changed something


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
        dict(temperature=1.3),
        dict(temperature=0.0),
    ],
    ids=["filtered-T0.7", "T1.3", "greedy"],
)
def test_sampling_logprobs_equal_teacher_forced(chaotic, settings):
    model, tok = chaotic
    params = SamplingParams(
        num_generations=3, max_completion_length=20, seed=0, stop_token_ids=[5, 7, 9], **settings
    )
    batch = RolloutEngine(model, tok).generate(PROMPTS, params)
    ref = teacher_forced_logprobs(model, batch, params.logprob_temperature)
    m = batch.completion_mask.bool()
    assert m.sum() > 40
    torch.testing.assert_close(batch.sampling_logprobs[m], ref[m], atol=2e-5, rtol=1e-5)
    assert (batch.sampling_logprobs[~m] == 0).all()


# ---------------------------------------------------------------------------------------------
# sampling statistics


def test_seeded_sampling_is_reproducible(chaotic):
    model, tok = chaotic
    engine = RolloutEngine(model, tok)
    params = SamplingParams(num_generations=4, max_completion_length=16, seed=123, top_p=0.95)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.sampling_logprobs, b.sampling_logprobs)
    assert a.completion_texts == b.completion_texts
    c = engine.generate(
        PROMPTS, SamplingParams(num_generations=4, max_completion_length=16, seed=124, top_p=0.95)
    )
    assert not torch.equal(a.completion_ids, c.completion_ids)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    unseeded = SamplingParams(num_generations=4, max_completion_length=16)
    assert torch.equal(
        engine.generate(PROMPTS, unseeded, generator=g1).completion_ids,
        engine.generate(PROMPTS, unseeded, generator=g2).completion_ids,
    )
    # the G completions of one prompt are different draws
    assert len({tuple(r) for r in a.completion_ids[:4].tolist()}) == 4


def _first_token_counts(model, tok, params, prompt):
    batch = RolloutEngine(model, tok).generate([prompt], params)
    return torch.bincount(batch.completion_ids[:, 0], minlength=model.config.vocab_size).double(), batch


def _next_token_logits(model, tok, prompt):
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits[0, -1].double()


@pytest.mark.parametrize(
    "settings", [dict(temperature=0.8), dict(temperature=1.2, top_k=20), dict(temperature=1.0, top_p=0.7)]
)
def test_empirical_next_token_distribution(chaotic, settings):
    model, tok = chaotic
    prompt = "The cat sat on a long road"
    params = SamplingParams(
        num_generations=4000, max_completion_length=1, length_bucket=1, seed=0, **settings
    )
    counts, batch = _first_token_counts(model, tok, params, prompt)
    logits = _next_token_logits(model, tok, prompt) / settings["temperature"]
    # reference filtering written independently of the engine: sort once, cut by rank / mass
    order = torch.argsort(logits, descending=True)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    k = settings.get("top_k") or logits.numel()
    p_sorted = torch.softmax(logits[order[:k]], 0)
    n_keep = k
    if settings.get("top_p", 1.0) < 1.0:
        n_keep = int((p_sorted.cumsum(0) - p_sorted < settings["top_p"]).sum())
    keep[order[:n_keep]] = True
    probs = torch.softmax(logits.masked_fill(~keep, -math.inf), 0)
    assert counts[~keep].sum() == 0, "sampled a token outside the top-k / top-p set"
    stat, dof = chi_square(counts, probs)
    assert dof >= 10
    assert chi_square_ok(stat, dof), (stat, dof)
    tv = 0.5 * (counts / counts.sum() - probs).abs().sum().item()
    assert tv < 0.12
    # power check: the unfiltered T=1 distribution is clearly rejected
    wrong = torch.softmax(_next_token_logits(model, tok, prompt), 0)
    assert not chi_square_ok(*chi_square(counts, wrong))
    # the reported log-probs are the unfiltered softmax(logits / T)
    full = torch.log_softmax(logits, 0)
    torch.testing.assert_close(
        batch.sampling_logprobs[:, 0].double(), full[batch.completion_ids[:, 0]], atol=2e-5, rtol=0
    )


def test_next_tokens_min_p_and_repetition_penalty_statistics():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]]).repeat(100_000, 1)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[:, 0] = True
    params = SamplingParams(temperature=0.9, min_p=0.1, repetition_penalty=1.3)
    gen = torch.Generator().manual_seed(0)
    tokens, lps = next_tokens(logits, params, seen, gen)
    work = logits[0].clone()
    work[0] = work[0] / 1.3
    probs = torch.softmax(work / 0.9, 0)
    probs = torch.where(probs >= 0.1 * probs.max(), probs, torch.zeros(()))
    probs = probs / probs.sum()
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[probs == 0].sum() == 0
    assert chi_square_ok(*chi_square(counts, probs.double()))
    torch.testing.assert_close(lps[:6], torch.log_softmax(logits[0] / 0.9, 0)[tokens[:6]])


def test_filter_logits_keeps_at_least_one_token():
    logits = torch.tensor([[5.0, 1.0, 0.5, 0.1]])
    out = filter_logits(logits, top_p=1e-6)
    assert torch.isfinite(out).sum() == 1 and torch.isfinite(out[0, 0])
    out = filter_logits(logits, top_k=2, min_p=0.99)
    assert torch.isfinite(out).sum() == 1


# ---------------------------------------------------------------------------------------------
# masks, stopping, compaction, bucketing


def _check_row_invariants(batch, stops, max_new, pad):
    for i in range(len(batch)):
        ids = batch.completion_ids[i].tolist()
        mask = batch.completion_mask[i].tolist()
        n = sum(mask)
        assert mask == [1] * n + [0] * (len(mask) - n)  # a prefix: nothing after the end counts
        assert batch.completion_lengths[i].item() == n
        assert all(t == pad for t in ids[n:])
        assert not any(t in stops for t in ids[: n - 1])
        if batch.truncated[i]:
            assert n == max_new and ids[n - 1] not in stops
        else:
            assert ids[n - 1] in stops
        assert (batch.sampling_logprobs[i, n:] == 0).all() and (batch.sampling_logprobs[i, :n] < 0).all()


def test_masks_stop_tokens_truncation_and_compaction(chaotic):
    model, tok = chaotic
    # ~3% of the vocabulary: lengths spread over 1..max and about a quarter of the rows truncated
    # (5-12 of 32 over seeds 0-7), so the assertions below do not hang on one lucky draw.
    stops = list(range(3, 20))
    params = SamplingParams(num_generations=8, max_completion_length=40, stop_token_ids=stops, seed=3,
                            length_bucket=64)
    engine = RolloutEngine(model, tok)
    batch = engine.generate(PROMPTS, params)
    stop_set = set(stops) | set(engine.eos_token_ids)
    _check_row_invariants(batch, stop_set, 40, tok.pad_token_id)
    assert batch.truncated.any() and not batch.truncated.all()
    sizes = batch.decode_batch_sizes
    assert sizes[0] == 32 and len(sizes) > 1 and all(b < a for a, b in zip(sizes, sizes[1:]))
    assert all(s & (s - 1) == 0 for s in sizes[1:])  # compacted batches are powers of two
    assert batch.completion_ids.shape[1] == 64
    for i in range(len(batch)):
        n = batch.completion_lengths[i].item()
        assert batch.completion_texts[i] == tok.decode(batch.completion_ids[i, :n], skip_special_tokens=True)
    # the reported log-probs stay exact after compaction
    ref = teacher_forced_logprobs(model, batch, 1.0)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.sampling_logprobs[m], ref[m], atol=2e-5, rtol=1e-5)


def test_compaction_and_bucketing_do_not_change_greedy_output(chaotic):
    model, tok = chaotic
    ref = hf_greedy(model, tok, PROMPTS, 30)
    stops = [int(ref[0, 3]), int(ref[2, 10])]
    base = dict(num_generations=2, temperature=0, max_completion_length=30, stop_token_ids=stops)
    outs = [
        RolloutEngine(model, tok, compact=False).generate(PROMPTS, SamplingParams(**base)),
        RolloutEngine(model, tok).generate(PROMPTS, SamplingParams(**base)),
        RolloutEngine(model, tok, sync_interval=3).generate(PROMPTS, SamplingParams(**base)),
        RolloutEngine(model, tok).generate(PROMPTS, SamplingParams(**base, length_bucket=0)),
        RolloutEngine(model, tok).generate(PROMPTS, SamplingParams(**base, length_bucket=16)),
    ]
    assert len(outs[1].decode_batch_sizes) > 1 and len(outs[0].decode_batch_sizes) == 1
    width = outs[0].completion_lengths.max().item()
    for out in outs[1:]:
        assert torch.equal(out.completion_ids[:, :width], outs[0].completion_ids[:, :width])
        assert torch.equal(out.completion_lengths, outs[0].completion_lengths)
        assert torch.equal(out.truncated, outs[0].truncated)
    assert outs[3].prompt_ids.shape[1] == max(
        len(tok(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS
    )
    assert outs[4].prompt_ids.shape[1] % 16 == 0 and outs[4].completion_ids.shape[1] % 16 == 0


def test_stop_strings_end_completion_and_are_cut_from_text(chaotic):
    model, tok = chaotic
    params = SamplingParams(num_generations=1, temperature=0, max_completion_length=24)
    engine = RolloutEngine(model, tok)
    full = engine.generate(PROMPTS, params)
    row = full.completion_ids[1, :24].tolist()
    # a stop string made of the text of tokens 5..7 of row 1
    prefix = tok.decode(row[:5], skip_special_tokens=True)
    stop = tok.decode(row[:8], skip_special_tokens=True)[len(prefix) :]
    assert stop.strip()
    for interval in (1, 4):
        out = RolloutEngine(model, tok, sync_interval=interval).generate(
            PROMPTS,
            SamplingParams(num_generations=1, temperature=0, max_completion_length=24, stop_strings=[stop]),
        )
        n = out.completion_lengths[1].item()
        assert n <= 8 and stop in tok.decode(row[:n], skip_special_tokens=True)
        assert stop not in tok.decode(row[: n - 1], skip_special_tokens=True)
        assert not out.truncated[1]
        assert out.completion_texts[1] == tok.decode(row[:n], skip_special_tokens=True).split(stop)[0]
        assert torch.equal(out.completion_ids[1, :n], full.completion_ids[1, :n])
        assert (out.completion_ids[1, n:] == tok.pad_token_id).all() and not out.completion_mask[1, n:].any()
        for i in range(len(out)):
            assert stop not in out.completion_texts[i]


# ---------------------------------------------------------------------------------------------
# prompts, batch layout, wrappers and precision


def test_chat_prompts_and_batch_layout(chaotic):
    model, tok = chaotic
    chats = [[{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "Say hello"}]]
    batch = RolloutEngine(model, tok).generate(
        chats, SamplingParams(num_generations=3, max_completion_length=8, seed=0, length_bucket=64)
    )
    rendered = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    assert batch.prompt_texts == [rendered[0]] * 3 + [rendered[1]] * 3
    assert batch.num_generations == 3 and batch.num_prompts == 2 and len(batch.completion_texts) == 6
    assert batch.prompt_ids.shape == batch.prompt_mask.shape and batch.prompt_ids.shape[1] % 64 == 0
    for i, text in enumerate(rendered):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for g in range(3):
            row = batch.prompt_ids[i * 3 + g]
            assert row[-len(ids) :].tolist() == ids  # left-padded
            assert batch.prompt_mask[i * 3 + g].sum().item() == len(ids)
            assert (row[: -len(ids)] == tok.pad_token_id).all()
    for t in (
        batch.prompt_ids,
        batch.completion_ids,
        batch.completion_mask,
        batch.sampling_logprobs,
        batch.truncated,
    ):
        assert t.device == next(model.parameters()).device


def test_works_with_lora_and_inference_mode(chaotic):
    from peft import LoraConfig

    from grpo_ascend.models.policy import apply_peft

    model, tok = chaotic
    ref = hf_greedy(model, tok, PROMPTS, 12)
    import copy

    peft_model = apply_peft(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.train()
    engine = RolloutEngine(peft_model, tok)
    greedy = SamplingParams(num_generations=1, temperature=0, max_completion_length=12)
    with torch.inference_mode():
        out = engine.generate(PROMPTS, greedy)
    assert torch.equal(out.completion_ids[:, :12], ref)  # fresh LoRA (B = 0) is the identity
    assert peft_model.training  # mode restored
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    batch = engine.generate(PROMPTS, SamplingParams(num_generations=2, max_completion_length=12, seed=0))
    peft_model.eval()
    ref_lp = teacher_forced_logprobs(peft_model, batch, 1.0)
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.sampling_logprobs[m], ref_lp[m], atol=2e-5, rtol=1e-5)
    assert not torch.equal(engine.generate(PROMPTS, greedy).completion_ids[:, :12], ref)


def test_bf16_autocast_on_cpu(chaotic):
    """Under bf16 autocast the cached decode's log-probs are a bf16 forward's, up to bf16 rounding.

    The tolerances are the size of bf16 rounding itself, measured on the same sampled tokens (a full
    bf16 forward against fp32), not fixed numbers: which tokens were sampled and the CPU's bf16
    kernels set that size (mean 0.024-0.029 over seeds 0-11 on one CPU, where the cached decode's
    mean distance to the bf16 forward was 0.60-0.81 of it and the former fixed bound of 0.02 failed
    for 3 seeds of 12). Logits scaled by 1.02 in the sampler put that distance at 1.17-1.43 of it.
    """
    model, tok = chaotic
    params = SamplingParams(num_generations=2, max_completion_length=12, temperature=0.9, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batch = RolloutEngine(model, tok).generate(PROMPTS, params)
        ref_bf16 = teacher_forced_logprobs(model, batch, 0.9)
    assert batch.sampling_logprobs.dtype == torch.float32
    m = batch.completion_mask.bool()
    assert torch.isfinite(batch.sampling_logprobs).all()
    ref_fp32 = teacher_forced_logprobs(model, batch, 0.9)
    rounding = (ref_bf16[m] - ref_fp32[m]).abs()  # what bf16 does to a full forward, on these tokens
    assert rounding.mean() < 0.1  # a bf16 forward, not a broken one
    diff = (batch.sampling_logprobs[m] - ref_bf16[m]).abs()
    assert diff.mean() < rounding.mean() and diff.max() < 2 * rounding.max(), (diff, rounding)
    assert (batch.sampling_logprobs[m] - ref_fp32[m]).abs().mean() < 1.5 * rounding.mean()


# ---------------------------------------------------------------------------------------------
# bad input


def test_bad_input_errors(chaotic):
    model, tok = chaotic
    engine = RolloutEngine(model, tok)
    with pytest.raises(DataError, match="empty"):
        engine.generate([])
    with pytest.raises(DataError, match="list"):
        engine.generate("a single string")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="prompt 1 "):
        engine.generate([{"role": "user"}] and ["ok", 3])  # type: ignore[list-item]
    long = " ".join(["river"] * 40)
    with pytest.raises(DataError, match=r"prompt 1 has \d+ tokens, more than max_prompt_length=16"):
        engine.generate(["short", long], SamplingParams(max_prompt_length=16, num_generations=1))
    with pytest.raises(ConfigError, match="max_completion_length"):
        SamplingParams(max_completion_length=0)
    with pytest.raises(ConfigError, match="max_completion_length"):
        SamplingParams(max_completion_length=-3)
    for top_p in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="top_p"):
            SamplingParams(top_p=top_p)
    with pytest.raises(ConfigError, match="prompt_truncation"):
        SamplingParams(prompt_truncation="right")
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="stop_strings"):
        SamplingParams(stop_strings="###")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.generate(["x"], SamplingParams(stop_token_ids=[10**7]))
    params = SamplingParams(num_generations=1)
    params.top_k = -1  # mutated after construction: caught at generate time
    with pytest.raises(ConfigError, match="top_k"):
        engine.generate(["x"], params)


def test_left_truncation_warns_and_keeps_the_end(chaotic, caplog):
    model, tok = chaotic
    long = " ".join(["river", "moon"] * 20)
    params = SamplingParams(
        max_prompt_length=16, prompt_truncation="left", num_generations=1, max_completion_length=2
    )
    with caplog.at_level(logging.WARNING, logger="grpo_ascend.rollout.prompts"):
        batch = RolloutEngine(model, tok).generate(["short", long], params)
    assert "truncated 1 prompt" in caplog.text and "[1]" in caplog.text
    ids = tok(long, add_special_tokens=False)["input_ids"]
    assert batch.prompt_mask[1].sum().item() == 16
    assert batch.prompt_ids[1, -16:].tolist() == ids[-16:]


def test_tokenizer_without_pad_uses_eos_and_says_so_once(chaotic, caplog):
    import copy

    model, tok = chaotic
    tok = copy.deepcopy(tok)
    tok.pad_token = None
    assert tok.pad_token_id is None
    with caplog.at_level(logging.WARNING, logger="grpo_ascend.rollout.engine"):
        engine = RolloutEngine(model, tok)
        b1 = engine.generate(PROMPTS, SamplingParams(num_generations=1, max_completion_length=4, seed=0))
        engine.generate(PROMPTS, SamplingParams(num_generations=1, max_completion_length=4, seed=0))
    assert caplog.text.count("no pad token") == 1
    assert engine.pad_token_id == tok.eos_token_id
    assert (b1.prompt_ids[3, :-1] == tok.eos_token_id).all()  # the 1-token prompt is padded with EOS


# ---------------------------------------------------------------------------------------------
# KV cache


def test_kv_cache_expand_select_and_bucketed_views():
    assert [round_up(n, 64) for n in (1, 64, 65)] == [64, 64, 128] and round_up(7, 0) == 7
    cache = BucketedKVCache(num_layers=2, capacity=8, bucket=4)
    k = torch.randn(2, 3, 5, 4)
    v = torch.randn(2, 3, 5, 4)
    keys, values = cache.update(k, v, 0)
    cache.update(k, v, 1)
    assert keys.shape[2] == 8 and cache.get_seq_length() == 5 and cache.get_mask_sizes(1, 0) == (8, 0)
    big = cache.expand_into(3, capacity=12)
    assert big.layers[0].keys.shape == (6, 3, 12, 4) and big.get_seq_length() == 5
    assert torch.equal(big.layers[1].values[4, :, :5], v[1]) and torch.equal(
        big.layers[0].keys[2, :, :5], k[0]
    )
    assert big.get_mask_sizes(1, 0) == (8, 0)
    keys, _ = big.update(torch.ones(6, 3, 1, 4), torch.ones(6, 3, 1, 4), 0)
    assert keys.shape[2] == 8 and (keys[:, :, 5] == 1).all()
    big.select_rows(torch.tensor([5, 0]))
    assert big.layers[0].keys.shape[0] == 2 and torch.equal(big.layers[0].keys[0, :, :5], k[1])
    with pytest.raises(RuntimeError, match="overflow"):
        big.layers[0].update(torch.ones(2, 3, 7, 4), torch.ones(2, 3, 7, 4))


def test_stop_string_before_a_stop_token_between_host_checks(chaotic):
    model, tok = chaotic
    engine = RolloutEngine(model, tok, sync_interval=4)
    full = engine.generate(
        PROMPTS, SamplingParams(num_generations=1, temperature=0, max_completion_length=24)
    )
    row = full.completion_ids[1, :24].tolist()
    assert row[5] not in row[:5]
    prefix = tok.decode(row[:2], skip_special_tokens=True)
    stop = tok.decode(row[:5], skip_special_tokens=True)[len(prefix) :]  # completed by token 4
    params = SamplingParams(
        num_generations=1,
        temperature=0,
        max_completion_length=24,
        stop_strings=[stop],
        stop_token_ids=[row[5]],
    )
    out = engine.generate(PROMPTS, params)  # token 5 ends the row at step 5, the next host check is at step 7
    n = out.completion_lengths[1].item()
    assert n <= 5 and stop in tok.decode(row[:n], skip_special_tokens=True)
    assert not out.completion_mask[1, n:].any() and (out.completion_ids[1, n:] == tok.pad_token_id).all()
