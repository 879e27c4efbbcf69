"""Lengths padded up to a bucket multiple, so shapes (KV caches, prompt and completion widths) repeat
across calls; the bucket itself is per device (grpo_ascend.device.default_length_bucket)."""

from __future__ import annotations


def round_up(n: int, bucket: int) -> int:
    """Smallest multiple of ``bucket`` that is >= ``n`` (``n`` itself when bucket <= 1)."""
    if bucket <= 1:
        return n
    return -(-n // bucket) * bucket
