"""A ZeRO-1/2 optimizer sharded over the ranks in a checkpoint: every rank writes its own shard
(``optimizer_shards/rank{R}.pt``) into the main rank's staging folder before the main rank finishes the
checkpoint, and reads its own shard back on resume."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo_ascend.checkpoints import files as io
from grpo_ascend.checkpoints.run_folders import CHECKPOINT_PREFIX, TMP_PREFIX, _require, read_manifest
from grpo_ascend.errors import CheckpointError

OPTIMIZER_SHARDS_DIR = "optimizer_shards"


def make_staging_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Create the hidden temporary folder a checkpoint of ``step`` is written into (main rank only).

    Pass it to :func:`write_optimizer_shard` on every rank and then to ``save_checkpoint(staging_dir=...)``.
    """
    return io.make_staging_dir(Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}")


def _shard_name(rank: int) -> str:
    return f"{OPTIMIZER_SHARDS_DIR}/rank{rank}.pt"


def write_optimizer_shard(staging_dir: str | os.PathLike, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's optimizer shard (plain tensors and Python values) into a staging folder, fsynced."""
    folder = Path(staging_dir)
    if not folder.name.startswith(TMP_PREFIX) or not folder.is_dir():
        raise CheckpointError(f"{str(folder)!r} is not a checkpoint staging folder made by make_staging_dir")
    path = folder / _shard_name(rank)
    path.parent.mkdir(exist_ok=True)
    io.torch_save(state, path)
    io.fsync_file(path)
    return path


def load_optimizer_shard(path: str | os.PathLike, rank: int, world_size: int) -> dict[str, Any]:
    """Read rank ``rank``'s optimizer shard from a checkpoint written by ``world_size`` ranks.

    The checkpoint's manifest is verified first; a checkpoint written by a different number of ranks
    (or without shards) is a CheckpointError, since each shard holds one rank's slice of the state.
    """
    folder = Path(path)
    manifest = read_manifest(folder, verify_hashes=True)
    saved = manifest.get("optimizer_shards")
    if saved is None:
        raise CheckpointError(
            f"{folder} holds one whole optimizer state, not per-rank shards: it was written without a sharded "
            "optimizer (no ZeRO); resume it the way it was trained"
        )
    if int(saved) != world_size:
        raise CheckpointError(
            f"{folder} holds optimizer shards of {saved} ranks but this run has {world_size}: the sharded "
            f"optimizer state can only be resumed with {saved} processes"
        )
    state = io.torch_load(_require(folder, manifest, _shard_name(rank), f"rank {rank}'s optimizer shard"))
    if not isinstance(state, dict):
        raise CheckpointError(f"{folder / _shard_name(rank)} does not hold an optimizer state dict")
    return state
