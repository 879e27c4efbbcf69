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
* **Images**: a vision-language model's prompts go with their pictures as multi-modal data (vision.py); its
  family is checked, and vLLM prepared for it (compat_vision.py), before the engine starts.
* **Sleep / wake** (``enable_sleep_mode``) frees the engine's device memory during training where the
  platform has it; vLLM's CPU build has none, which is logged once.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.errors import ConfigError
from grpo_ascend.rollout.policy_weights import PolicyWeights
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.vllm import import_vllm
from grpo_ascend.rollout.vllm.base import VLLMBackend
from grpo_ascend.rollout.vllm.compat_vision import prepare_vllm_for_vision
from grpo_ascend.rollout.vllm.requests import LOGPROBS_MODE, Completion, ImagePrompt
from grpo_ascend.rollout.vllm.vision import check_expansion, served_image_token
from grpo_ascend.rollout.vllm.weights import (
    DEFAULT_BUCKET_BYTES,
    lora_rank,
    remove_folder,
    streamed,
    weight_buckets,
    write_adapter,
)

logger = logging.getLogger(__name__)

#: LoRA ranks vLLM can reserve room for; an adapter's rank is rounded up to the next one.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM reserves that holds ``rank``."""
    for r in VLLM_LORA_RANKS:
        if rank <= r:
            return r
    raise ConfigError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]}); use a smaller r")


class VLLMColocatedRollout(VLLMBackend):
    """Grouped completions from an in-process vLLM engine, with the sampler's per-token log-probs.

    ``model_path``: the folder (or hub id) of the policy's base weights, loaded once. ``lora_rank``:
    the policy's LoRA rank (None: full fine-tuning). ``device``: where the returned tensors live (the
    trainer's). ``dtype``: vLLM's weights (fp32 for exact log-prob parity on the CPU).
    ``kv_cache_memory_bytes`` overrides ``gpu_memory_utilization`` (a fraction of the device's memory;
    on the CPU, of the host's). ``adapter_dir``: where adapter versions are written (default: a
    temporary folder, deleted by :meth:`close`). ``bucket_bytes``: the bound of one full-sync bucket.
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
        self._own_adapter_dir = adapter_dir is None
        self._adapter_root = Path(adapter_dir) if adapter_dir is not None else Path(tempfile.mkdtemp(prefix="vllm-lora-"))
        self._lora: Any = None  # the LoRARequest of the adapter version being served
        self._lora_ids = 0
        self._version: int | None = None
        self._asleep = False
        self.bucket_bytes = int(bucket_bytes)
        self.image_token = served_image_token(model_path, cpu_attention=_cpu_platform())
        if self.image_token is not None:
            prepare_vllm_for_vision()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # binding would pin the trainer's threads too
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        set_threads(threads)
        sleep_mode = bool(enable_sleep_mode) and self._sleep_available()
        kwargs: dict[str, Any] = dict(
            model=model_path, dtype=dtype, enforce_eager=True, seed=seed, logprobs_mode=LOGPROBS_MODE,
            gpu_memory_utilization=gpu_memory_utilization, model_impl=model_impl, enable_sleep_mode=sleep_mode,
        )
        if _cpu_platform():
            # vLLM's CPU build cannot rewind a seeded request's generator after a partial prefill ("CPU
            # Generator does not use offset"), which chunked prefill makes as soon as one batch's prompts
            # exceed its token budget: prefill whole prompts (the budget becomes at least max_model_len).
            kwargs["enable_chunked_prefill"] = False
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_memory_bytes)
        if max_model_length is not None:
            kwargs["max_model_len"] = int(max_model_length)
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=1)
        started = time.perf_counter()
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads  # vLLM's CPU worker replaced it with a no-op
        self.start_seconds = time.perf_counter() - started
        self.sleep_mode = sleep_mode
        if enable_sleep_mode and not sleep_mode:
            logger.warning("vllm_enable_sleep_mode: this platform's vLLM has no sleep mode (the CPU build has none); "
                           "the engine keeps its memory between rounds")
        logger.info("vLLM colocated engine started in %.1f s (%s, %s)", self.start_seconds, model_path, dtype)
        hf_eos = getattr(self.llm.llm_engine.model_config.hf_text_config, "eos_token_id", None)  # a VLM's: its text's
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        eos += [int(i) for i in (hf_eos if isinstance(hf_eos, (list, tuple)) else [hf_eos]) if i is not None]
        super().__init__(tokenizer, params, device=device, eos_token_ids=list(dict.fromkeys(eos)),
                         length_bucket=length_bucket)

    @staticmethod
    def _sleep_available() -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available())

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def complete(self, prompt_ids: Sequence[Sequence[int]], fields: Sequence[dict[str, Any]],
                 keys: Sequence[int] | None = None,
                 images: Sequence[ImagePrompt | None] | None = None) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        pictures = list(images) if images is not None else [None] * len(prompt_ids)
        prompts = [TokensPrompt(prompt_token_ids=list(p)) if img is None else
                   TokensPrompt(prompt_token_ids=list(p), multi_modal_data={"image": list(img.pictures)})
                   for p, img in zip(prompt_ids, pictures)]
        outputs = self.llm.generate(prompts, [VLLMSamplingParams(**f) for f in fields], lora_request=self._lora,
                                    use_tqdm=False)
        for out, img in zip(outputs, pictures):
            if img is not None:
                check_expansion(img.expanded, out.prompt_token_ids, img.index, len(img.pictures))
        return [[_completion(o) for o in out.outputs] for out in outputs]

    # ------------------------------------------------------------------ weight sync

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Sample from ``weights`` from now on: a new adapter version, or the full weights reloaded in
        buckets; then the prefix cache is reset. A version already held is not sent again."""
        if weights.version == self._version and weights.version is not None:
            return
        self.restore_memory()
        started = time.perf_counter()
        if weights.adapter_only:
            self._load_adapter(weights)
        else:
            buckets = weight_buckets(weights.named_tensors(), self.bucket_bytes, dtype=self._dtype())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": streamed(buckets)})
            self.llm.collective_rpc(refresh_tied_head)
        self.reset_prefix_cache()
        self._version = weights.version
        self.last_sync_seconds = time.perf_counter() - started

    def _dtype(self) -> torch.dtype:
        return self.llm.llm_engine.model_config.dtype

    def _load_adapter(self, weights: PolicyWeights) -> None:
        from vllm.lora.request import LoRARequest

        lora_config = self.llm.llm_engine.vllm_config.lora_config
        config = weights.adapter_config()
        if lora_config is None:
            raise ConfigError("this vLLM engine was started without LoRA (lora_rank=None) but the policy is a LoRA "
                              "model; start it with the adapter's rank")
        if lora_rank(config) > lora_config.max_lora_rank:
            raise ConfigError(f"the adapter's LoRA rank {lora_rank(config)} is above the engine's max_lora_rank "
                              f"{lora_config.max_lora_rank}")
        self._lora_ids += 1
        new_id = self._lora_ids
        folder = write_adapter(config, weights.named_tensors(), self._adapter_root / f"adapter-{new_id}")
        request = LoRARequest(lora_name=f"policy-{new_id}", lora_int_id=new_id, lora_path=str(folder))
        self.llm.llm_engine.add_lora(request)
        old, self._lora = self._lora, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            remove_folder(Path(old.lora_path))

    @property
    def served_adapter(self) -> tuple[int, str] | None:
        """(vLLM adapter id, folder) of the adapter version being served; None before a LoRA sync."""
        return None if self._lora is None else (self._lora.lora_int_id, self._lora.lora_path)

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
        """Delete the adapter folders this engine wrote (the engine stays up for a later train or evaluate)."""
        if self._own_adapter_dir:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
        elif self._lora is not None:
            remove_folder(Path(self._lora.lora_path))

    def shutdown(self) -> None:
        """:meth:`close`, and end the in-process engine now; it samples no more. vLLM tears down the process's
        distributed state when an engine ends: a process that makes another engine later (a second trainer, a
        test module) ends the old one first, or the garbage collector may end it under the new one."""
        self.close()
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is not None:
            client.shutdown()  # idempotent: it detaches vLLM's own finalizer


def refresh_tied_head(worker: Any) -> None:
    """Rebuild the output head's prepared weights after a reload when it is tied to the embeddings.

    vLLM's CPU build packs the head's weight for its GEMM kernel when the model loads; a reload
    writes the new values through the embedding (the tied parameter) and leaves the head's packed
    copy stale, so every logit would still come from the old embeddings. Re-running the head's
    post-load step repacks it (it does nothing on other platforms).
    """
    repack_tied_head(worker.model_runner.model)


def repack_tied_head(model: Any) -> None:
    """:func:`refresh_tied_head` on a vLLM model (what a worker-side loader that holds the model calls)."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    method = getattr(head, "quant_method", None)
    if method is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None):
        method.process_weights_after_loading(head)


def _cpu_platform() -> bool:
    """Whether this vLLM is its CPU build."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _completion(output: Any) -> Completion:
    """One vLLM CompletionOutput as token ids, the sampled tokens' log-probs and whether it stopped."""
    ids = [int(t) for t in output.token_ids]
    logprobs = [float(step[t].logprob) for t, step in zip(ids, output.logprobs or [])]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens; request logprobs=0")
    return Completion(token_ids=ids, logprobs=logprobs, stopped=output.finish_reason == "stop")
