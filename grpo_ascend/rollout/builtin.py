"""The ``"builtin"`` rollout backend: the built-in engine on the policy module itself (``rollout_mode: sync``),
or in a rollout process of its own with its own copy of the policy (``one_step_off`` / ``async``)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from grpo_ascend import device as dev
from grpo_ascend.rollout.backend import RolloutBackend
from grpo_ascend.rollout.engine import RolloutEngine
from grpo_ascend.rollout.process.client import ProcessBackend, ProcessSettings
from grpo_ascend.rollout.sampling import SamplingParams
from grpo_ascend.weight_transfer.settings import rollout_process_transfer

logger = logging.getLogger(__name__)


def build_builtin_backend(policy: nn.Module, tokenizer: Any, params: SamplingParams, args: Any) -> RolloutBackend:
    """The engine over ``policy`` in this process, or a rollout process placed by the device layer."""
    if getattr(args, "rollout_mode", "sync") == "sync":
        dev.use_trainer_threads(None)
        return RolloutEngine(policy, tokenizer, params)
    trainer_device = next(policy.parameters()).device
    place = dev.rollout_placement(trainer_device, args.rollout_device, args.rollout_threads)
    dev.use_trainer_threads(place)
    transfer, why = rollout_process_transfer(getattr(args, "weight_transfer", "auto"), trainer_device, place.device)
    logger.info("rollout process: %s", why)
    settings = ProcessSettings(
        device=place.device, threads=place.threads, precision=dev.run_precision(place.device, args.bf16, args.fp16),
        max_restarts=args.max_rollout_restarts,
        heartbeat_stale_after_s=args.heartbeat_stale_after_s, request_timeout=args.request_timeout,
        weight_sync_timeout=args.weight_sync_timeout, partial_rollouts=args.partial_rollouts,
        transfer=transfer, bucket_bytes=getattr(args, "weight_transfer_bucket_bytes", None),
    )
    return ProcessBackend(policy, tokenizer, params, settings, trainer_device, version=0)

