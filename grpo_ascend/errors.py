"""Error types for problems a user can fix: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GrpoAscendError(Exception):
    """Base class for errors caused by user input (config, data, paths, devices)."""


class ConfigError(GrpoAscendError, ValueError):
    """A configuration value is missing, unknown or out of range."""


class DeviceError(GrpoAscendError, RuntimeError):
    """A requested device is not usable on this machine."""


class DataError(GrpoAscendError, ValueError):
    """A dataset or prompt batch is malformed."""


class RewardError(GrpoAscendError, RuntimeError):
    """A reward function failed or returned something unusable."""


class CheckpointError(GrpoAscendError, RuntimeError):
    """A checkpoint is missing, truncated or does not match the model."""


def closest(name: str, candidates: Iterable[str]) -> str:
    """Return ' (did you mean X?)' for the closest candidate to ``name``, or '' if none is close."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


class CompatError(GrpoAscendError, RuntimeError):
    """An installed library changed an internal grpo-ascend relies on (see the distributed/compat_* and models/compat_peft modules)."""


class RolloutError(GrpoAscendError, RuntimeError):
    """A rollout process or producer failed: it died past its restarts, stopped its heartbeat, or a weight sync timed out."""


class RolloutInterrupted(RolloutError):
    """A sampler lost the work in flight and recovered (a rollout process restarted mid-session): sample it again."""
