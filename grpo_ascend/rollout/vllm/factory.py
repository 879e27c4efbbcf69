"""``rollout_backend: vllm``: the colocated engine or the server client, from the run's ``vllm_*`` settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from grpo_ascend.errors import ConfigError
from grpo_ascend.models.vision_language import is_vision_language
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.rollout.vllm.base import VLLMBackend
from grpo_ascend.rollout.vllm.colocated import VLLMColocatedRollout
from grpo_ascend.rollout.vllm.server import VLLMServerRollout
from grpo_ascend.rollout.vllm.server_pool import server_urls
from grpo_ascend.rollout.vllm.weights import lora_rank


def base_model_path(policy: nn.Module) -> str:
    """The folder or hub id the policy's base weights were loaded from (what vLLM loads once)."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    path = getattr(base.config, "_name_or_path", "") or getattr(base, "name_or_path", "")
    if not path:
        raise ConfigError("rollout_backend 'vllm' loads the policy's base weights from their folder, but this model "
                          "was built in memory; save it with save_pretrained and pass the folder as the model")
    return str(path)


def check_adapter_targets(policy: nn.Module) -> None:
    """vLLM applies a vision-language model's LoRA to its language model only (it ignores, with a warning, adapter
    weights on the vision tower or projector): refuse such an adapter, whose samples would not be the policy's."""
    outside = sorted({name.rsplit(".lora_A", 1)[0] for name, _ in policy.named_parameters()
                      if ".lora_A" in name and ".language_model." not in name})
    if outside:
        raise ConfigError(f"rollout_backend 'vllm' applies LoRA to the language model only, but the adapter also "
                          f"adapts {outside[:3]}{' ...' if len(outside) > 3 else ''}; train those parts without LoRA "
                          "or leave them out of train_vision_parts, or sample with the built-in engine (use_vllm: false)")


def _dtype(args: Any) -> str:
    if getattr(args, "bf16", False):
        return "bfloat16"
    return "float16" if getattr(args, "fp16", False) else "float32"


def build_vllm_backend(policy: nn.Module, tokenizer: Any, params: SamplingParams, args: Any) -> VLLMBackend:
    """The vLLM backend ``args.vllm_mode`` names, serving the policy's base (docs/vllm.md)."""
    device = next(policy.parameters()).device
    path = base_model_path(policy)
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    if is_vision_language(base.config):
        check_adapter_targets(policy)
    bucket = params.length_bucket or 1
    if args.vllm_mode == "server":
        urls = server_urls(args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}")
        sync_dir = args.vllm_sync_dir or str(Path(args.output_dir) / "vllm-sync")
        # ahead of training, one_step_off pins the previous version: keep it loaded beside the newest
        keep = 1 if getattr(args, "rollout_mode", "sync") == "sync" else 2
        return VLLMServerRollout(urls, path, tokenizer, params, adapter_dir=sync_dir, device=device,
                                 start_timeout=args.vllm_server_timeout, request_timeout=args.request_timeout,
                                 sync_timeout=args.weight_sync_timeout, length_bucket=bucket, keep_versions=keep,
                                 weight_transfer=getattr(args, "weight_transfer", "auto"),
                                 transfer_bucket_bytes=getattr(args, "weight_transfer_bucket_bytes", None),
                                 transfer_host=getattr(args, "weight_transfer_host", None))
    peft_config = getattr(policy, "peft_config", None)
    rank = lora_rank(next(iter(peft_config.values())).to_dict()) if peft_config else None
    return VLLMColocatedRollout(
        path, tokenizer, params, device=device, lora_rank=rank, dtype=_dtype(args),
        max_model_length=args.vllm_max_model_length, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=args.vllm_kv_cache_memory_bytes, tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode, model_impl=args.vllm_model_impl, seed=args.seed,
        length_bucket=bucket,
    )
