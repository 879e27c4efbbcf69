"""vLLM in the trainer's process: an in-process engine on the trainer's device, synced every round.

* **Start**: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in this process, so weights
  pass as tensors, not through pickles), eager mode, the KV cache sized by ``kv_cache_memory_bytes``
  or ``gpu_memory_utilization``. vLLM's CPU worker binds OpenMP threads and replaces
  ``torch.set_num_threads`` with a no-op: the thread count is set before the engine starts, binding is
  off unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise, and the function is given back afterwards.
* **LoRA sync**: the adapter only, written atomically to a new folder and loaded under a **new
  adapter id** every round (vLLM keeps serving an id's first weights), the previous id evicted
  and its folder deleted. The base weights are loaded once.
* **Full sync**: the policy's tensors streamed in bounded buckets into
  ``model_runner.reload_weights(weights_iterator=...)``; a head tied to the embeddings is then
  repacked (:func:`refresh_tied_head`: vLLM's CPU build otherwise keeps the old head).
* After every sync the **prefix cache is reset**: cached blocks of a prompt hold keys/values of the
  old weights, and a prompt longer than one cache block would reuse them.
* **Sleep / wake** (``enable_sleep_mode``) frees the engine's device memory during training where the
  platform has it; vLLM's CPU build has none, which is logged once.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpo_ascend.adapters import is_peft
from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.engine import RolloutBatch
from grpo_ascend.rollout.prompts import Prompt, render_prompts, tokenize_prompts
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.vllm import import_vllm
from grpo_ascend.rollout.vllm.requests import (
    LOGPROBS_MODE,
    Completion,
    build_batch,
    request_seed,
    sampling_fields,
)
from grpo_ascend.rollout.vllm.weights import (
    DEFAULT_BUCKET_BYTES,
    lora_rank,
    named_weights,
    remove_folder,
    streamed,
    weight_buckets,
    write_adapter,
)

logger = logging.getLogger(__name__)

#: LoRA ranks vLLM can reserve room for; an adapter's rank is rounded up to the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _vllm_lora_rank(rank: int) -> int:
    for r in VLLM_LORA_RANKS:
        if rank <= r:
            return r
    raise ConfigError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]}); use a smaller r")


class VLLMColocatedRollout:
    """Grouped completions from an in-process vLLM engine, with the sampler's per-token log-probs.

    ``model_path``: the folder (or hub id) of the policy's base weights, loaded once. ``lora_rank``:
    the policy's LoRA rank (None: full fine-tuning). ``device``: where the returned tensors live (the
    trainer's). ``dtype``: vLLM's weights (fp32 for exact log-prob parity on the CPU).
    ``kv_cache_memory_bytes`` overrides ``gpu_memory_utilization`` (a fraction of the device's memory;
    on the CPU, of the host's). ``adapter_dir``: where adapter versions are written (default: a
    temporary folder). ``length_bucket``: padding multiple of the returned tensors.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        params: SamplingParams,
        *,
        device: torch.device | str = "cpu",
        lora_rank: int | None = None,
        dtype: str = "float32",
        max_model_length: int | None = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        model_impl: str = "vllm",
        seed: int = 0,
        adapter_dir: str | os.PathLike | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        length_bucket: int = 1,
    ) -> None:
        if tensor_parallel_size != 1:
            raise ConfigError(
                f"vllm_tensor_parallel_size={tensor_parallel_size} with vllm_mode='colocate': a colocated engine "
                "here runs on its rank's device alone; use 1, or vllm_mode='server' with a tensor-parallel server"
            )
        vllm = import_vllm()
        self.tokenizer = tokenizer
        self.params = params
        self.device = torch.device(device)
        self.length_bucket = max(1, int(length_bucket))
        self.bucket_bytes = int(bucket_bytes)
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
        self._adapter_root = Path(adapter_dir) if adapter_dir is not None else Path(tempfile.mkdtemp(prefix="vllm-lora-"))
        self._lora: Any = None  # the LoRARequest of the adapter version being served
        self._lora_version = 0
        self._asleep = False
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # binding would pin the trainer's threads too
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        set_threads(threads)
        kwargs: dict[str, Any] = dict(
            model=model_path, dtype=dtype, enforce_eager=True, seed=seed, logprobs_mode=LOGPROBS_MODE,
            gpu_memory_utilization=gpu_memory_utilization, model_impl=model_impl,
            enable_sleep_mode=enable_sleep_mode and self._sleep_available(),
        )
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if max_model_length is not None:
            kwargs["max_model_len"] = int(max_model_length)
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=_vllm_lora_rank(lora_rank), max_loras=1)
        started = time.perf_counter()
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads  # vLLM's CPU worker replaced it with a no-op
        self.sleep_mode = bool(kwargs["enable_sleep_mode"])
        if enable_sleep_mode and not self.sleep_mode:
            logger.warning("vllm_enable_sleep_mode: this platform's vLLM has no sleep mode (the CPU build has none); "
                           "the engine keeps its memory between rounds")
        self.start_seconds = time.perf_counter() - started
        logger.info("vLLM colocated engine started in %.1f s (%s, %s)", self.start_seconds, model_path, dtype)

    @staticmethod
    def _sleep_available() -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available())

    # ------------------------------------------------------------------ generation

    @property
    def eos_token_ids(self) -> list[int]:
        """The EOS ids vLLM stops at: the tokenizer's plus the generation config's."""
        ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        extra = self.llm.llm_engine.model_config.hf_config.eos_token_id
        for i in extra if isinstance(extra, (list, tuple)) else [extra]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
        return ids

    @torch.no_grad()
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | None = None,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        """``params.num_generations`` completions per prompt (prompt order, G rows each) with the sampler's log-probs."""
        params = params if params is not None else self.params
        params.validate()
        texts = render_prompts(self.tokenizer, prompts, params.chat_template_kwargs)
        ids, texts = tokenize_prompts(self.tokenizer, texts, params.max_prompt_length, params.prompt_truncation)
        return self.generate_ids(ids, texts, params, generator)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], prompt_texts: Sequence[str], params: SamplingParams,
                     generator: torch.Generator | None = None) -> RolloutBatch:
        """As :meth:`generate` for prompts already tokenized (token ids in, token ids out)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        self.restore_memory()
        seed = request_seed(params, generator)
        G = params.num_generations
        requests = [VLLMSamplingParams(**sampling_fields(params, None if seed is None else seed + i * G))
                    for i in range(len(prompt_ids))]
        started = time.perf_counter()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids], requests,
                                    lora_request=self._lora, use_tqdm=False)
        groups = [[_completion(o) for o in out.outputs] for out in outputs]
        batch = build_batch(self.tokenizer, prompt_ids, prompt_texts, groups, params, self.pad_token_id,
                            self.device, self.length_bucket)
        batch.timing["total_s"] = time.perf_counter() - started
        return batch

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self, policy: nn.Module, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> dict[str, float]:
        """Make the engine sample from ``policy``'s current weights; returns timings for the round's log.

        A PEFT policy sends its adapter; any other sends ``weights`` (default: its parameters by name;
        a sharded strategy passes its whole weights) in buckets. The prefix cache is reset either way.
        """
        self.restore_memory()
        started = time.perf_counter()
        if is_peft(policy):
            self._load_adapter(policy)
        else:
            buckets = weight_buckets(weights if weights is not None else named_weights(policy), self.bucket_bytes,
                                     dtype=self._dtype(), device=None)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": streamed(buckets)})
            self.llm.collective_rpc(refresh_tied_head)
        self.reset_prefix_cache()
        return {"vllm/sync_s": time.perf_counter() - started}

    def _dtype(self) -> torch.dtype:
        return self.llm.llm_engine.model_config.dtype

    def _load_adapter(self, policy: nn.Module) -> None:
        from vllm.lora.request import LoRARequest

        if self._lora is None and lora_rank(policy) > self.llm.llm_engine.vllm_config.lora_config.max_lora_rank:
            raise ConfigError(f"the policy's LoRA rank {lora_rank(policy)} is above the engine's max_lora_rank")
        self._lora_version += 1
        version = self._lora_version
        folder = write_adapter(policy, self._adapter_root / f"adapter-{version}")
        request = LoRARequest(lora_name=f"policy-{version}", lora_int_id=version, lora_path=str(folder))
        self.llm.llm_engine.add_lora(request)
        old, self._lora = self._lora, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            remove_folder(Path(old.lora_path))

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt blocks (computed with the previous weights)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    # ------------------------------------------------------------------ memory

    def release_memory(self) -> None:
        """Free the engine's weights and KV cache on the device while the trainer trains (sleep mode only)."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def restore_memory(self) -> None:
        """Bring the engine's memory back before sampling or syncing (sleep mode only)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Delete adapter folders written by this engine."""
        if self._lora is not None:
            remove_folder(Path(self._lora.lora_path))


def refresh_tied_head(worker: Any) -> None:
    """Rebuild the output head's prepared weights after a reload when it is tied to the embeddings.

    vLLM's CPU build packs the head's weight for its GEMM kernel when the model loads; a reload
    writes the new values through the embedding (the tied parameter) and leaves the head's packed
    copy stale, so every logit would still come from the old embeddings. Re-running the head's
    post-load step repacks it (it does nothing on other platforms).
    """
    model = worker.model_runner.model
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    method = getattr(head, "quant_method", None)
    if method is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None):
        method.process_weights_after_loading(head)


def _completion(output: Any) -> Completion:
    """One vLLM CompletionOutput as token ids, the sampled tokens' log-probs and whether it stopped."""
    ids = [int(t) for t in output.token_ids]
    logprobs = [float(step[t].logprob) for t, step in zip(ids, output.logprobs or [])]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens; request logprobs=0")
    return Completion(token_ids=ids, logprobs=logprobs, stopped=output.finish_reason == "stop")
