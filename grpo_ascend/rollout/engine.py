"""The built-in rollout backend: G sampled completions per prompt, on the device, with few distinct shapes.

How one :meth:`RolloutEngine.generate` call runs:

1. Prompts (plain text or chat messages rendered with the tokenizer's chat template) are
   tokenized (:mod:`grpo_ascend.rollout.prompts`), checked against ``max_prompt_length`` and
   left-padded to a bucketed length ``Lp``.
2. **Prefill once per prompt** (:meth:`RolloutEngine.prefill`): one forward at batch P over
   ``[P, Lp]`` into a :class:`~grpo_ascend.rollout.kv_cache.BucketedKVCache`, computing logits for
   the last position only. The cache is then copied G times (row ``i*G + g`` = prompt ``i``) into a
   preallocated decode cache of ``Lp + round_up(max_completion_length)`` columns (or shared by the
   G rows, :mod:`grpo_ascend.rollout.shared_prefix`); the G completions share the prompt's
   keys/values instead of recomputing them.
3. **Decode** one token per step at batch ``B <= P*G`` (:class:`~grpo_ascend.rollout.decoding.DecodeBatch`).
   Each step writes the sampled token, its log-prob and mask into preallocated ``[N, Lc]`` output
   tensors by row index (no host copy). Every ``sync_interval`` steps the host reads how many rows
   are still running (the only per-step synchronisation; stop strings add a decode of the newest
   tokens); when that number falls to a smaller power-of-two bucket, the finished rows are dropped
   from the batch and from the cache (compaction), so finished sequences stop costing compute
   while the batch keeps one of log2(N) shapes. Key/value lengths seen by attention are bucketed
   the same way.
4. Masks, truncation flags and decoded texts are built once at the end.

Multi-turn rollouts run on the same prefill and decode state through :meth:`RolloutEngine.start_session`
(:mod:`grpo_ascend.rollout.session`).

Position ids come from the cumulative prompt mask (as ``generate`` does), so left padding does
not shift positions; greedy decoding matches ``model.generate`` token for token.

Hybrid decoders (Qwen3-Next, Qwen3.5, NemotronH: linear-attention or Mamba2 layers beside attention
layers, :mod:`grpo_ascend.models.layer_kinds`) keep each row's convolution window and recurrent state
in the same cache: computed once in the prompt's prefill, copied to its G rows, compacted with them
(:mod:`grpo_ascend.models.recurrent_state`). Their decode never shares a prefix (the state is per row).

The engine runs the model in eval mode (restoring the previous mode afterwards), works under
``torch.no_grad``/``torch.inference_mode``, under a caller's autocast context and with
PEFT-wrapped policies, and never names a device type: everything stays on the model's device.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from grpo_ascend import device as device_layer
from grpo_ascend.errors import ConfigError
from grpo_ascend.length_buckets import round_up
from grpo_ascend.models.layer_kinds import layer_kinds, text_decoder_config
from grpo_ascend.models.recurrent_state import states_per_layer
from grpo_ascend.rollout.backend import RolloutBackend, RolloutBatch
from grpo_ascend.rollout.decoding import Completions, DecodeBatch, PromptBatch, stop_token_list
from grpo_ascend.rollout.kv_cache import BucketedKVCache
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.prompts import Prompt, left_pad
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.session import BuiltinSession
from grpo_ascend.rollout.shared_prefix import SharedPrefixKVCache, supports_shared_prefix
from grpo_ascend.rollout.stop_strings import StopStrings
from grpo_ascend.vision.inputs import PromptImages, RowVision
from grpo_ascend.vision.positions import prompt_positions

__all__ = ["Prompt", "RolloutBatch", "RolloutEngine"]

logger = logging.getLogger(__name__)


class RolloutEngine(RolloutBackend):
    """Samples ``num_generations`` completions per prompt with a shared-prefill, bucketed KV cache.

    ``sync_interval`` is how many decode steps run between host checks of "how many rows are
    still running" (None: every step on the CPU, where a check is free, every 4 steps on an
    accelerator). ``compact=False`` keeps finished rows in the batch (for comparison/debugging).
    """

    samples_policy_module = True
    streams_weights = False
    takes_images = True
    takes_tool_images = True

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
        #: Called at each host check of a single-turn decode with the number of tokens sampled so far, before
        #: the next step's forward: a rollout process swaps in newer weights there (partial rollouts).
        self.between_steps: Callable[[int], None] | None = None
        self.compact = compact
        self._compiled: tuple[str, nn.Module] | None = None  # (device type, compiled decode model)
        self._prefix_supported: bool | None = None  # supports_shared_prefix(model), asked once
        self._base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(self._base, "config", None)
        if config is None:
            raise ConfigError(
                f"the rollout engine needs a transformers causal LM with a .config, got {type(model).__name__}"
            )
        text_config = text_decoder_config(config)
        self.layer_kinds = layer_kinds(config)  # attention, recurrent (linear attention, Mamba2) or stateless layers
        self.num_layers = len(self.layer_kinds)
        self._recurrent_states = states_per_layer(config)
        self.vocab_size = int(text_config.vocab_size)
        self._sync_interval = sync_interval
        self._pad = self._resolve_pad()
        params_of = inspect.signature(type(self._base).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params_of else "past_key_values"
        if "logits_to_keep" in params_of:
            self._keep_kwarg: str | None = "logits_to_keep"
        elif "num_logits_to_keep" in params_of:
            self._keep_kwarg = "num_logits_to_keep"
        else:
            self._keep_kwarg = None
    # ------------------------------------------------------------------ properties

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
    def pad_token_id(self) -> int:
        """The tokenizer's pad id, else its EOS id (with a warning at construction)."""
        return self._pad

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids that end a completion: the tokenizer's plus the model's generation_config ones."""
        return self._resolve_eos()

    def length_bucket(self, params: SamplingParams) -> int:
        """The bucket prompt and completion widths are rounded up to (``params``', else the device's default)."""
        return params.length_bucket if params.length_bucket is not None else device_layer.default_length_bucket(self.device)

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

    # ------------------------------------------------------------------ the model

    def decode_model(self, params: SamplingParams) -> nn.Module:
        """The model one-token decode steps call: compiled once per device type when asked, else the model."""
        device = self.device
        wanted = params.compile_decode if params.compile_decode is not None else device_layer.default_compile_decode(device)
        if not wanted:
            return self.model
        if self._compiled is None or self._compiled[0] != device.type:
            self._compiled = (device.type, device_layer.compile_for_decode(self.model, device))
        return self._compiled[1]

    def _shares_prefix(self, params: SamplingParams, device: torch.device, group: int, compiled: bool) -> bool:
        """Whether this rollout's decode reads each prompt's keys/values once (rollout/shared_prefix.py)."""
        wanted = params.shared_prefix
        if wanted is None:
            wanted = device_layer.default_shared_prefix_decode(device) and not compiled
        if not wanted or group < 2:
            return False
        if self._prefix_supported is None:
            self._prefix_supported = supports_shared_prefix(self.model)
            if not self._prefix_supported:
                logger.info("the model's layers are not all plain causal softmax attention (sliding windows, "
                            "soft-capping, attention sinks or a hybrid decoder's recurrent layers): decoding with "
                            "the plain KV cache (each completion holds its own copy of the prompt)")
        return self._prefix_supported

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: BucketedKVCache,
        model: nn.Module | None = None, images: Mapping[str, Tensor] | None = None, embeds: Tensor | None = None,
    ) -> Tensor:
        """One forward (of ``model``, default the engine's) with the cache; the last position's logits [B, V].
        ``images``: the prompts' image inputs (a prefill of prompts with images); ``embeds``: the input embeddings
        to use instead of ``input_ids``' (a fed segment holding tool images)."""
        kwargs = {
            **({"inputs_embeds": embeds} if embeds is not None else {"input_ids": input_ids}),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            self._cache_kwarg: cache,
            "use_cache": True,
            **(images or {}),
        }
        if self._keep_kwarg is not None:
            kwargs[self._keep_kwarg] = 1
        out = (model if model is not None else self.model)(**kwargs)
        return out.logits[:, -1]

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """The model in eval mode inside the block, its previous mode restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            if was_training:
                self.model.train()

    # ------------------------------------------------------------------ the seam

    def checked(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` (default the run's) validated, stop token ids inside the vocabulary."""
        params = super().checked(params)
        for i, t in enumerate(params.stop_token_ids):
            if t >= self.vocab_size:
                raise ConfigError(f"stop_token_ids[{i}]={t} is outside the vocabulary (size {self.vocab_size})")
        return params

    def sampling_generator(self, params: SamplingParams, generator: torch.Generator | None) -> torch.Generator | None:
        """``generator``, or a new one on the model's device seeded with ``params.seed`` when set."""
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        return generator

    @torch.no_grad()
    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None,
        generator: torch.Generator | None = None, prompt_texts: Sequence[str] | None = None,
    ) -> RolloutBatch:
        """Sample ``params.num_generations`` completions for each prompt; see the module docstring."""
        return self._generate(prompt_ids, None, params, generator, prompt_texts)

    @torch.no_grad()
    def generate_with_images(
        self, prompt_ids: Sequence[Sequence[int]], images: Sequence[PromptImages], params: SamplingParams | None = None,
        generator: torch.Generator | None = None, prompt_texts: Sequence[str] | None = None,
    ) -> RolloutBatch:
        """As :meth:`generate_ids`, each prompt's images encoded once in its prefill (not once per completion)."""
        return self._generate(prompt_ids, list(images), params, generator, prompt_texts)

    def _generate(self, prompt_ids: Sequence[Sequence[int]], images: list[PromptImages] | None,
                  params: SamplingParams | None, generator: torch.Generator | None,
                  prompt_texts: Sequence[str] | None) -> RolloutBatch:
        params = self.checked(params)
        texts = (list(prompt_texts) if prompt_texts is not None
                 else self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False))
        generator = self.sampling_generator(params, generator)
        with self.evaluating():
            return self._rollout(prompt_ids, texts, params, generator, images)

    def start_session(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> BuiltinSession:
        """Contexts continued until a stop, on this engine's prefill and decode state (one cache, never re-prefilled)."""
        params = self.checked(params)
        return BuiltinSession(self, prompt_ids, params, self.sampling_generator(params, generator))

    def start_image_session(
        self, prompt_ids: Sequence[Sequence[int]], images: Sequence[PromptImages | None],
        params: SamplingParams | None = None, generator: torch.Generator | None = None,
    ) -> BuiltinSession:
        """As :meth:`start_session`, each prompt's images encoded once in its prefill; its rows take tool images."""
        params = self.checked(params)
        return BuiltinSession(self, prompt_ids, params, self.sampling_generator(params, generator), images)

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Nothing to copy: the engine runs the policy module itself."""
        return None

    def release_memory(self) -> None:
        """Nothing is held between rollouts (each rollout's cache is freed at its end)."""
        return None

    def restore_memory(self) -> None:
        """Nothing was released."""
        return None

    # ------------------------------------------------------------------ prefill and decode

    def prefill(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, generator: torch.Generator | None = None,
        *, shared_prefix: bool = True, images: Sequence[PromptImages | None] | None = None,
    ) -> DecodeBatch:
        """One forward per prompt (last-position logits) into a cache its G rows share: the start of a decode.

        ``shared_prefix=False`` always copies the prompt's keys/values into each row (needed when
        rows are fed several tokens at once). ``images``: each prompt's image inputs (vision/inputs.py).
        """
        dev, bucket, group = self.device, self.length_bucket(params), params.num_generations
        ids, mask = left_pad(prompt_ids, self.pad_token_id, bucket, dev)
        lp = ids.shape[1]
        image_inputs = RowVision(images).forward_kwargs(None, mask) if images is not None else {}
        position_ids, next_positions = prompt_positions(self._base, ids, mask, image_inputs)
        prefill_cache = BucketedKVCache(self.num_layers, lp, bucket, self.layer_kinds, self._recurrent_states)
        logits = self.forward(ids, mask, position_ids, prefill_cache, images=image_inputs)
        lc = round_up(params.max_completion_length, bucket)
        decode_model = self.decode_model(params)
        if shared_prefix and self._shares_prefix(params, dev, group, compiled=decode_model is not self.model):
            cache: Any = SharedPrefixKVCache(prefill_cache, mask, group, lc)
        else:
            cache = prefill_cache.expand_into(group, lp + lc)
        del prefill_cache
        if dev.type != "cpu":  # honest phase timings: wait for the queued device work
            device_layer.synchronize(dev)
        return DecodeBatch(
            prompts=PromptBatch(ids, mask, [len(r) for r in prompt_ids], next_positions), params=params,
            generator=generator,
            pad=self.pad_token_id, stop_ids=stop_token_list(params, self.eos_token_ids), cache=cache, logits=logits,
            completion_width=lc, bucket=bucket, forward=self.forward, decode_model=decode_model, compact=self.compact,
            image_model=self._base,
        )

    def _rollout(
        self, prompt_ids: Sequence[Sequence[int]], prompt_texts: list[str], params: SamplingParams,
        generator: torch.Generator | None, images: list[PromptImages] | None = None,
    ) -> RolloutBatch:
        t_start = time.perf_counter()
        batch = self.prefill(prompt_ids, params, generator, images=images)
        t_prefill = time.perf_counter()
        out = Completions(batch.n_rows, batch.completion_width, self.pad_token_id, self.device)
        steps = self._decode(batch, out, params)
        truncated = torch.zeros(batch.n_rows, dtype=torch.bool, device=out.ids.device)
        truncated[batch.row_map] = ~batch.done
        batch.release()
        lengths = out.mask.sum(dim=1)
        lengths_host = lengths.tolist()
        out.trim(lengths_host, batch.bucket)
        t_decode = time.perf_counter()
        completion_texts = self.prompts.decode_completions(out.ids, lengths_host, params.stop_strings)
        t_end = time.perf_counter()
        group = params.num_generations
        rows_ids, rows_mask = batch.prompts.rows(group)
        return RolloutBatch(
            prompt_ids=rows_ids, prompt_mask=rows_mask, completion_ids=out.ids, completion_mask=out.mask.long(),
            sampling_logprobs=out.logprobs, truncated=truncated,
            prompt_texts=[text for text in prompt_texts for _ in range(group)], completion_texts=completion_texts,
            num_generations=group, completion_lengths=lengths,
            timing={
                "prefill_s": t_prefill - t_start,
                "decode_s": t_decode - t_prefill,
                "decode_text_s": t_end - t_decode,
                "total_s": t_end - t_start,
                "steps": float(steps),
                "tokens": float(sum(lengths_host)),
            },
            decode_batch_sizes=batch.batch_sizes,
            vision=RowVision.repeated(images, group) if images is not None else None,
        )

    def _decode(self, batch: DecodeBatch, out: Completions, params: SamplingParams) -> int:
        """Single-turn decode: token ``t`` of every running row into column ``t``; the steps run."""
        max_new, interval = params.max_completion_length, self.sync_interval
        stop_strings = StopStrings(self.tokenizer, params.stop_strings, self.pad_token_id) if params.stop_strings else None
        done_at_check = batch.done  # rows already finished at the previous host check
        steps = 0
        with batch.cache.decoding(self.model):
            for t in range(max_new):
                tokens, lps = batch.sample()
                done, rows = batch.done, batch.row_map
                out.ids[rows, t] = tokens
                out.logprobs[rows, t] = lps.masked_fill(done, 0.0)
                out.mask[rows, t] = ~done
                stops = batch.stopped(tokens)
                if stops is not None:
                    batch.done = done | stops
                steps = t + 1
                last = t == max_new - 1
                check = last or (t + 1) % interval == 0
                if check and stop_strings is not None:
                    batch.done = stop_strings.check(t, rows, ~done_at_check, batch.done, out.ids, out.logprobs, out.mask)
                if last:
                    break
                if check:
                    n_alive = int((~batch.done).sum())
                    if n_alive == 0:
                        break
                    batch.compact(n_alive)
                    done_at_check = batch.done
                    if self.between_steps is not None:
                        self.between_steps(t + 1)
                batch.step()
        return steps
