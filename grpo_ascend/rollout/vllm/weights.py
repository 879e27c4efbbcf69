"""What a weight sync sends to vLLM: a LoRA adapter folder, or the policy's named tensors in bounded buckets.

LoRA runs send the adapter only (PEFT's format, the base stays loaded once in vLLM). Full fine-tuning
streams the policy's tensors under their Hugging Face names, a bucket of at most ``bucket_bytes`` at a
time converted to vLLM's dtype and device, so at most one bucket is ever copied (none when the
trainer and vLLM share dtype and device).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.checkpoints.files import AtomicFolder, save_tensors, write_json

#: PEFT's file names, which vLLM reads.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: Default bucket of a full-weight sync.
DEFAULT_BUCKET_BYTES = 256 * 2**20


def lora_rank(config: Mapping[str, Any]) -> int:
    """The largest LoRA rank of a PEFT adapter config (ranks per module included)."""
    return max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])


def write_adapter(config: Mapping[str, Any], tensors: Iterable[tuple[str, torch.Tensor]], folder: Path) -> Path:
    """Write an adapter (PEFT config dict, PEFT state-dict names) to ``folder`` in PEFT's format,
    atomically: a reader sees the whole previous folder or the whole new one, never a partial write."""
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    config["inference_mode"] = True
    with AtomicFolder(folder) as tmp:
        save_tensors(tmp / ADAPTER_WEIGHTS, dict(tensors))
        write_json(tmp / ADAPTER_CONFIG, config, "the adapter config")
    return folder


def remove_folder(folder: Path | None) -> None:
    """Delete an adapter folder vLLM no longer serves (missing is fine)."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def weight_buckets(weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                   dtype: torch.dtype | None = None,
                   device: torch.device | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``weights`` grouped into buckets of at most ``bucket_bytes`` (one larger tensor makes a bucket of
    its own), each tensor converted to ``dtype`` / ``device`` (no copy where they already match)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.to(dtype=dtype or tensor.dtype, device=device or tensor.device)))
        size += nbytes
    if bucket:
        yield bucket


def streamed(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``buckets`` one by one; a bucket is released before the next is made."""
    for bucket in buckets:
        yield from bucket
        bucket.clear()
