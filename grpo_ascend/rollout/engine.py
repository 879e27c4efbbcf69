"""Grouped rollout engine: G sampled completions per prompt, on the device, with few distinct shapes.

How one :meth:`RolloutEngine.generate` call runs:

1. Prompts (plain text or chat messages rendered with the tokenizer's chat template) are
   tokenized, checked against ``max_prompt_length`` and left-padded to a bucketed length ``Lp``.
2. **Prefill once per prompt**: one forward at batch P over ``[P, Lp]`` into a
   :class:`~grpo_ascend.rollout.kv_cache.BucketedKVCache`, computing logits for the last position
   only. The cache is then copied G times (row ``i*G + g`` = prompt ``i``) into a preallocated
   decode cache of ``Lp + round_up(max_completion_length)`` columns; the G completions share the
   prompt's keys/values instead of recomputing them.
3. **Decode** one token per step at batch ``B <= P*G``. Each step writes the sampled token, its
   log-prob and mask into preallocated ``[N, Lc]`` output tensors by row index (no host copy).
   Every ``sync_interval`` steps the host reads how many rows are still running (the only per-step
   synchronisation; stop strings add a decode of the newest tokens); when that number falls to a
   smaller power-of-two bucket, the finished rows are dropped from the batch and from the cache
   (compaction), so finished sequences stop costing compute while the batch keeps one of
   log2(N) shapes. Key/value lengths seen by attention are bucketed the same way.
4. Masks, truncation flags and decoded texts are built once at the end.

Position ids come from the cumulative prompt mask (as ``generate`` does), so left padding does
not shift positions; greedy decoding matches ``model.generate`` token for token.

The engine runs the model in eval mode (restoring the previous mode afterwards), works under
``torch.no_grad``/``torch.inference_mode``, under a caller's autocast context and with
PEFT-wrapped policies, and never names a device type: everything stays on the model's device.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from grpo_ascend.device import (
    compile_for_decode,
    default_compile_decode,
    default_length_bucket,
    default_shared_prefix_decode,
)
from grpo_ascend.errors import ConfigError, DataError
from grpo_ascend.rollout.kv_cache import BucketedKVCache, round_up
from grpo_ascend.rollout.sampling import SamplingParams, next_tokens
from grpo_ascend.rollout.shared_prefix import SharedPrefixKVCache, supports_shared_prefix

logger = logging.getLogger(__name__)

Prompt = str | Sequence[Mapping[str, object]]


@dataclass
class RolloutBatch:
    """Sampled completions for a batch of prompts, every tensor on the model's device.

    ``N = num_prompts * num_generations``; rows ``i*G .. i*G+G-1`` belong to prompt ``i``.
    ``completion_mask`` is 1 up to and including the first EOS/stop token (or up to the length
    limit) and 0 after; ``completion_ids`` hold the pad id and ``sampling_logprobs`` 0 where the
    mask is 0. ``sampling_logprobs`` are ``log_softmax(logits / T)`` of the chosen tokens, before
    any top-k/top-p/min-p/repetition-penalty filtering (T = 1 for greedy); see
    :mod:`grpo_ascend.rollout.sampling`. ``prompt_texts`` are the rendered prompts (chat template
    applied), one per row like ``completion_texts``. Extras: ``completion_lengths`` [N] (tokens
    counted by the mask), ``timing`` (seconds per phase, steps, tokens) and ``decode_batch_sizes``
    (the batch size after each compaction, starting with N).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    sampling_logprobs: Tensor
    truncated: Tensor
    prompt_texts: list[str]
    completion_texts: list[str]
    num_generations: int
    completion_lengths: Tensor | None = None
    timing: dict[str, float] = field(default_factory=dict)
    decode_batch_sizes: list[int] = field(default_factory=list)

    @property
    def num_prompts(self) -> int:
        """Number of distinct prompts."""
        return self.prompt_ids.shape[0] // self.num_generations

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


def _row_buckets(n: int) -> list[int]:
    """Batch sizes the decode loop may run at: n, then the powers of two below n (descending)."""
    sizes = {n}
    p = 1
    while p < n:
        sizes.add(p)
        p *= 2
    return sorted(sizes, reverse=True)


class RolloutEngine:
    """Samples ``num_generations`` completions per prompt with a shared-prefill, bucketed KV cache.

    ``sync_interval`` is how many decode steps run between host checks of "how many rows are
    still running" (None: every step on the CPU, where a check is free, every 4 steps on an
    accelerator). ``compact=False`` keeps finished rows in the batch (for comparison/debugging).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        params: SamplingParams | None = None,
        *,
        sync_interval: int | None = None,
        compact: bool = True,
    ) -> None:
        if sync_interval is not None and (
            isinstance(sync_interval, bool) or not isinstance(sync_interval, int) or sync_interval < 1
        ):
            raise ConfigError(f"sync_interval must be None or an int >= 1, got {sync_interval!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.params = params if params is not None else SamplingParams()
        self.compact = compact
        self._compiled: tuple[str, nn.Module] | None = None  # (device type, compiled decode model)
        self._prefix_supported: bool | None = None  # supports_shared_prefix(model), asked once
        self._base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(self._base, "config", None)
        if config is None:
            raise ConfigError(
                f"the rollout engine needs a transformers causal LM with a .config, got {type(model).__name__}"
            )
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layer_types = (
            getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
        )
        unsupported = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if unsupported:
            raise ConfigError(
                f"the rollout engine supports attention-only decoders; this model has layer types {unsupported}. "
                "Use model.generate for it."
            )
        self.num_layers = len(layer_types)
        self.vocab_size = int(text_config.vocab_size)
        self._sync_interval = sync_interval
        self.pad_token_id = self._resolve_pad()
        params_of = inspect.signature(type(self._base).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params_of else "past_key_values"
        if "logits_to_keep" in params_of:
            self._keep_kwarg: str | None = "logits_to_keep"
        elif "num_logits_to_keep" in params_of:
            self._keep_kwarg = "num_logits_to_keep"
        else:
            self._keep_kwarg = None

    # ------------------------------------------------------------------ setup helpers

    @property
    def device(self) -> torch.device:
        """The model's device (read at every call, so moving the model is picked up)."""
        return next(self.model.parameters()).device

    @property
    def sync_interval(self) -> int:
        """Decode steps between host checks: as configured, else 1 on the CPU and 4 on accelerators."""
        if self._sync_interval is not None:
            return self._sync_interval
        return 1 if self.device.type == "cpu" else 4

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids that end a completion: the tokenizer's plus the model's generation_config ones."""
        return self._resolve_eos()

    def _resolve_pad(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is not None:
            return int(pad)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            raise ConfigError(
                "the tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token before rollouts"
            )
        logger.warning("tokenizer has no pad token: padding rollouts with the EOS token id %d", eos)
        return int(eos)

    def _resolve_eos(self) -> list[int]:
        ids: list[int] = []
        candidates = [getattr(self.tokenizer, "eos_token_id", None)]
        gen_config = getattr(self._base, "generation_config", None)
        if gen_config is not None:
            candidates.append(getattr(gen_config, "eos_token_id", None))
        for c in candidates:
            for i in c if isinstance(c, (list, tuple)) else [c]:
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
        return ids

    def _decode_model(self, params: SamplingParams, device: torch.device) -> nn.Module:
        """The model the decode steps call: compiled once per device type when asked, else the model."""
        wanted = params.compile_decode if params.compile_decode is not None else default_compile_decode(device)
        if not wanted:
            return self.model
        if self._compiled is None or self._compiled[0] != device.type:
            self._compiled = (device.type, compile_for_decode(self.model, device))
        return self._compiled[1]

    def _shares_prefix(self, params: SamplingParams, device: torch.device, group: int, compiled: bool) -> bool:
        """Whether this rollout's decode reads each prompt's keys/values once (rollout/shared_prefix.py)."""
        wanted = params.shared_prefix
        if wanted is None:
            wanted = default_shared_prefix_decode(device) and not compiled
        if not wanted or group < 2:
            return False
        if self._prefix_supported is None:
            self._prefix_supported = supports_shared_prefix(self.model)
            if not self._prefix_supported:
                logger.info("the model's attention is not plain causal softmax attention: decoding with the plain "
                            "KV cache (each completion holds its own copy of the prompt)")
        return self._prefix_supported

    def _forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        cache: BucketedKVCache,
        model: nn.Module | None = None,
    ) -> Tensor:
        """One forward (of ``model``, default the engine's) with the cache; the last position's logits [B, V]."""
        kwargs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            self._cache_kwarg: cache,
            "use_cache": True,
        }
        if self._keep_kwarg is not None:
            kwargs[self._keep_kwarg] = 1
        out = (model if model is not None else self.model)(**kwargs)
        return out.logits[:, -1]

    # ------------------------------------------------------------------ prompts

    def _render(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[str]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise DataError(
                f"prompts must be a list of strings or chat message lists, got {type(prompts).__name__}; wrap one prompt in a list"
            )
        if len(prompts) == 0:
            raise DataError("the prompt list is empty: pass at least one prompt")
        texts = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                texts.append(p)
            elif isinstance(p, Sequence) and all(isinstance(m, Mapping) for m in p) and len(p) > 0:
                if getattr(self.tokenizer, "chat_template", None) is None:
                    raise DataError(
                        f"prompt {i} is a chat message list but the tokenizer has no chat template; "
                        "set tokenizer.chat_template or pass plain-text prompts"
                    )
                texts.append(
                    self.tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True,
                                                       **dict((params or self.params).chat_template_kwargs or {}))
                )
            else:
                raise DataError(
                    f"prompt {i} must be a string or a non-empty list of {{'role', 'content'}} dicts, got {p!r:.80}"
                )
        return texts

    def _tokenize(self, texts: list[str], params: SamplingParams) -> tuple[list[list[int]], list[str]]:
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        limit = params.max_prompt_length
        cut = []
        for i, row in enumerate(ids):
            if len(row) == 0:
                raise DataError(
                    f"prompt {i} is empty after tokenization; every prompt needs at least one token"
                )
            if limit is not None and len(row) > limit:
                if params.prompt_truncation == "error":
                    raise DataError(
                        f"prompt {i} has {len(row)} tokens, more than max_prompt_length={limit}; shorten it, "
                        "raise max_prompt_length, or set prompt_truncation='left' to keep its last tokens"
                    )
                ids[i] = row[-limit:]
                texts[i] = self.tokenizer.decode(ids[i], skip_special_tokens=False)
                cut.append(i)
        if cut:
            logger.warning(
                "truncated %d prompt(s) from the left to max_prompt_length=%d (indices %s)",
                len(cut),
                limit,
                cut[:20],
            )
        return ids, texts

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> RolloutBatch:
        """Sample ``params.num_generations`` completions for each prompt; see the module docstring."""
        params = params if params is not None else self.params
        params.validate()
        for i, t in enumerate(params.stop_token_ids):
            if t >= self.vocab_size:
                raise ConfigError(
                    f"stop_token_ids[{i}]={t} is outside the vocabulary (size {self.vocab_size})"
                )
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompts, params, generator)
        finally:
            if was_training:
                self.model.train()

    def _generate(
        self, prompts: list[Prompt], params: SamplingParams, generator: torch.Generator | None
    ) -> RolloutBatch:
        t_start = time.perf_counter()
        dev, pad = self.device, self.pad_token_id
        bucket = params.length_bucket if params.length_bucket is not None else default_length_bucket(dev)
        group, max_new = params.num_generations, params.max_completion_length
        interval = self.sync_interval
        ids, rendered = self._tokenize(self._render(prompts, params), params)
        n_prompts, n_rows = len(ids), len(ids) * group

        # Left-padded prompt batch at a bucketed length, built on the host and copied once.
        lens = [len(r) for r in ids]
        lp = round_up(max(lens), bucket)
        host_ids = torch.tensor([[pad] * (lp - len(r)) + r for r in ids], dtype=torch.long)
        host_mask = torch.arange(lp).unsqueeze(0) >= torch.tensor([lp - n for n in lens]).unsqueeze(1)
        prompt_ids, prompt_mask = host_ids.to(dev), host_mask.to(dev)
        prompt_len = torch.tensor(lens, dtype=torch.long).to(dev)

        # Prefill once per prompt (last-position logits only), then share the cache across the group.
        position_ids = (prompt_mask.long().cumsum(-1) - 1).clamp_min(0)
        prefill_cache = BucketedKVCache(self.num_layers, lp, bucket)
        logits = self._forward(prompt_ids, prompt_mask, position_ids, prefill_cache)
        lc = round_up(max_new, bucket)
        decode_model = self._decode_model(params, dev)
        if self._shares_prefix(params, dev, group, compiled=decode_model is not self.model):
            cache = SharedPrefixKVCache(prefill_cache, prompt_mask, group, lc)
        else:
            cache = prefill_cache.expand_into(group, lp + lc)
        del prefill_cache
        _synchronize(dev)
        t_prefill = time.perf_counter()

        logits = logits.repeat_interleave(group, dim=0)
        vocab = logits.shape[-1]
        row_len = prompt_len.repeat_interleave(group)
        attn = torch.zeros((n_rows, lp + lc), dtype=torch.bool, device=dev)
        attn[:, :lp] = prompt_mask.repeat_interleave(group, dim=0)
        seen = None
        if params.repetition_penalty != 1.0:
            seen_prompt = torch.zeros((n_prompts, vocab + 1), dtype=torch.bool, device=dev)
            seen_prompt.scatter_(1, prompt_ids.masked_fill(~prompt_mask, vocab), True)
            seen = seen_prompt[:, :vocab].repeat_interleave(group, dim=0)
        stop_list = sorted(
            set(([] if params.ignore_eos else self.eos_token_ids) + [int(t) for t in params.stop_token_ids])
        )
        stop_ids = torch.tensor(stop_list, dtype=torch.long, device=dev) if stop_list else None
        stop_strings = _StopStrings(self.tokenizer, params.stop_strings, pad) if params.stop_strings else None

        out_ids = torch.full((n_rows, lc), pad, dtype=torch.long, device=dev)
        out_lp = torch.zeros((n_rows, lc), dtype=torch.float32, device=dev)
        out_mask = torch.zeros((n_rows, lc), dtype=torch.bool, device=dev)
        row_map = torch.arange(n_rows, device=dev)  # decode-batch row -> output row
        done = torch.zeros(n_rows, dtype=torch.bool, device=dev)
        done_at_check = done  # rows already finished at the previous host check
        buckets = _row_buckets(n_rows)
        batch_sizes = [n_rows]

        steps = 0
        with cache.decoding(self.model):
            for t in range(max_new):
                tokens, lps = next_tokens(logits, params, seen, generator)
                tokens = tokens.masked_fill(done, pad)
                out_ids[row_map, t] = tokens
                out_lp[row_map, t] = lps.masked_fill(done, 0.0)
                out_mask[row_map, t] = ~done
                if seen is not None:
                    seen.scatter_(1, tokens.unsqueeze(1), True)
                if stop_ids is not None:
                    done = done | (tokens.unsqueeze(1) == stop_ids).any(dim=1)
                steps = t + 1
                last = t == max_new - 1
                check = last or (t + 1) % interval == 0
                if check and stop_strings is not None:
                    done = stop_strings.check(t, row_map, ~done_at_check, done, out_ids, out_lp, out_mask)
                if last:
                    break
                if check:
                    n_alive = int((~done).sum())
                    if n_alive == 0:
                        break
                    target = min(b for b in buckets if b >= n_alive)
                    if self.compact and target < tokens.shape[0]:
                        keep = torch.argsort(done.to(torch.int32), stable=True)[:target]  # running rows first
                        cache.select_rows(keep)
                        row_map, tokens, row_len, attn, done = (
                            row_map[keep],
                            tokens[keep],
                            row_len[keep],
                            attn[keep],
                            done[keep],
                        )
                        if seen is not None:
                            seen = seen[keep]
                        batch_sizes.append(target)
                    done_at_check = done
                attn[:, lp + t] = True
                view = cache.layers[0].view_length(lp + t + 1)
                logits = self._forward(
                    tokens.unsqueeze(1), attn[:, :view], (row_len + t).unsqueeze(1), cache, decode_model
                )
        del cache, logits

        truncated = torch.zeros(n_rows, dtype=torch.bool, device=dev)
        truncated[row_map] = ~done
        lengths = out_mask.sum(dim=1)
        lengths_host = lengths.tolist()
        width = min(lc, round_up(max(lengths_host), bucket))
        if width < lc:
            out_ids, out_lp, out_mask = (x[:, :width].contiguous() for x in (out_ids, out_lp, out_mask))
        t_decode = time.perf_counter()

        rows = out_ids.tolist()
        completion_texts = self.tokenizer.batch_decode(
            [r[:n] for r, n in zip(rows, lengths_host)], skip_special_tokens=True
        )
        if params.stop_strings:
            completion_texts = [_cut_at_stop(s, params.stop_strings) for s in completion_texts]
        t_end = time.perf_counter()
        return RolloutBatch(
            prompt_ids=prompt_ids.repeat_interleave(group, dim=0),
            prompt_mask=prompt_mask.long().repeat_interleave(group, dim=0),
            completion_ids=out_ids,
            completion_mask=out_mask.long(),
            sampling_logprobs=out_lp,
            truncated=truncated,
            prompt_texts=[text for text in rendered for _ in range(group)],
            completion_texts=completion_texts,
            num_generations=group,
            completion_lengths=lengths,
            timing={
                "prefill_s": t_prefill - t_start,
                "decode_s": t_decode - t_prefill,
                "decode_text_s": t_end - t_decode,
                "total_s": t_end - t_start,
                "steps": float(steps),
                "tokens": float(sum(lengths_host)),
            },
            decode_batch_sizes=batch_sizes,
        )


def _synchronize(device: torch.device) -> None:
    """Wait for queued device work (for honest phase timings); a no-op on the CPU."""
    if device.type == "cpu":
        return
    from grpo_ascend.device import synchronize

    synchronize(device)


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """Text before the earliest occurrence of any stop string (unchanged if none occurs)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


class _StopStrings:
    """Host-side stop-string detection over the newest completion tokens of the running rows.

    At each check only a window of recent columns is decoded (long enough to contain any stop
    string), and the first column whose prefix text contains a stop string ends the row there:
    later tokens of that row are reset to pad / mask 0 / log-prob 0.
    """

    def __init__(self, tokenizer, stops: Sequence[str], pad: int) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.pad = pad
        # A string of c characters is at most 4c UTF-8 bytes, hence at most 4c byte-level tokens.
        self.window = 4 * max(len(s) for s in self.stops) + 2
        self.checked = 0  # columns before this one were already checked

    def _hit(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def check(
        self,
        t: int,
        row_map: Tensor,
        candidates: Tensor,
        done: Tensor,
        out_ids: Tensor,
        out_lp: Tensor,
        out_mask: Tensor,
    ) -> Tensor:
        """Scan columns up to ``t`` of the ``candidates`` rows (running at the previous check).

        Rows that ended by a stop token since then are scanned too: a stop string completed
        before that token ends them earlier. Returns the updated ``done``.
        """
        lo = max(0, self.checked - self.window)
        active = torch.nonzero(candidates).flatten()
        hits: list[tuple[int, int, int]] = []
        if active.numel():
            rows = row_map[active]
            block = out_ids[rows, lo : t + 1].tolist()
            for a, r, toks in zip(active.tolist(), rows.tolist(), block):
                if not self._hit(toks):
                    continue
                end = next(j for j in range(lo, t + 1) if self._hit(toks[: j - lo + 1]))
                hits.append((a, r, max(end, self.checked)))
        self.checked = t + 1
        if not hits:
            return done
        dev = done.device
        a_idx = torch.tensor([h[0] for h in hits], device=dev)
        r_idx = torch.tensor([h[1] for h in hits], device=dev)
        ends = torch.tensor([h[2] for h in hits], device=dev)
        after = torch.arange(out_ids.shape[1], device=dev).unsqueeze(0) > ends.unsqueeze(1)
        out_ids[r_idx] = out_ids[r_idx].masked_fill(after, self.pad)
        out_lp[r_idx] = out_lp[r_idx].masked_fill(after, 0.0)
        out_mask[r_idx] = out_mask[r_idx] & ~after
        done = done.clone()
        done[a_idx] = True
        return done
