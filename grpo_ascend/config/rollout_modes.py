"""The asynchronous-rollout settings (``rollout_mode`` and TRL's AsyncGRPOConfig names), checked (docs/async.md)."""

from __future__ import annotations

from typing import Any

from grpo_ascend.config.fields import _positive
from grpo_ascend.errors import ConfigError, closest

ROLLOUT_MODES = ("sync", "one_step_off", "async")


def check_async_settings(cfg: Any) -> None:
    """The asynchronous-rollout settings: known mode, sane bounds, a sampler that can run ahead."""
    if cfg.rollout_mode not in ROLLOUT_MODES:
        raise ConfigError(f"rollout_mode must be one of {list(ROLLOUT_MODES)}, got {cfg.rollout_mode!r}"
                          f"{closest(str(cfg.rollout_mode), ROLLOUT_MODES)}")
    _positive(cfg, "queue_maxsize", "weight_sync_steps", "heartbeat_stale_after_s", "request_timeout",
              "weight_sync_timeout")
    if cfg.partial_rollouts not in ("continue", "abort"):
        raise ConfigError(f"partial_rollouts must be 'continue' or 'abort', got {cfg.partial_rollouts!r}")
    if cfg.max_staleness < 0:
        raise ConfigError(f"max_staleness must be >= 0 policy versions, got {cfg.max_staleness}")
    if cfg.max_inflight_tasks != -1 and cfg.max_inflight_tasks < 1:
        raise ConfigError(f"max_inflight_tasks must be -1 (auto) or >= 1 prompts, got {cfg.max_inflight_tasks}")
    if cfg.max_rollout_restarts < 0:
        raise ConfigError(f"max_rollout_restarts must be >= 0, got {cfg.max_rollout_restarts}")
    if cfg.rollout_threads is not None and cfg.rollout_threads < 1:
        raise ConfigError(f"rollout_threads must be null or >= 1, got {cfg.rollout_threads}")
    if cfg.rollout_mode != "sync" and (cfg.use_vllm or cfg.rollout_backend == "vllm") and cfg.vllm_mode == "colocate":
        raise ConfigError(f"rollout_mode={cfg.rollout_mode!r} with a colocated vLLM engine: it samples on the "
                          "trainer's device between steps, so it cannot run ahead. Use vllm_mode: server (a vLLM / "
                          "vllm-ascend server running the sampler), or the built-in engine (rollout_backend: builtin, "
                          "which starts a rollout process of its own), or rollout_mode: sync")
