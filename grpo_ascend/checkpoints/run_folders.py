"""A run's ``checkpoint-N`` folders: their names, the manifest that makes one complete, finding the latest
complete one, pruning old ones and clearing what a crashed save left behind.

What a checkpoint holds, and saving and loading one, are in :mod:`grpo_ascend.checkpoints.checkpoint`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.checkpoints import files as io
from grpo_ascend.checkpoints.files import MANIFEST_NAME
from grpo_ascend.errors import CheckpointError

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = io.TMP_PREFIX + CHECKPOINT_PREFIX
TRASH_PREFIX = io.TRASH_PREFIX + CHECKPOINT_PREFIX
FORMAT_NAME = "grpo-ascend-checkpoint"
FORMAT_VERSION = 1

_STEP_RE = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step in a ``checkpoint-N`` folder name, or None for any other name."""
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------------------------


def _write_manifest(folder: Path, step: int, weights: Mapping[str, Any]) -> None:
    """The checkpoint's manifest: format, step, how the weights are stored, and every file's hash."""
    header = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "created": time.time(),
        "torch": torch.__version__,
        **weights,
    }
    io.write_manifest(folder, header)


def read_manifest(path: str | os.PathLike, verify_hashes: bool = True) -> dict[str, Any]:
    """Validate a checkpoint folder against its manifest and return the manifest.

    Every listed file must exist with its recorded size (and, with ``verify_hashes``, its sha256).
    Raises CheckpointError naming the first missing, truncated or damaged file.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {str(folder)!r} does not exist or is not a folder")
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{manifest_path} is missing: {folder.name} is not a complete grpo-ascend checkpoint (the save "
            f"was interrupted, or the folder was not written by grpo-ascend); use an earlier checkpoint"
        )
    manifest = io.read_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path} is not a grpo-ascend checkpoint manifest")
    if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} has format version {manifest.get('format_version')} but this grpo-ascend reads "
            f"up to {FORMAT_VERSION}; upgrade grpo-ascend"
        )
    io.check_manifest_files(folder, manifest["files"], verify_hashes)
    return manifest


def _incomplete_reason(folder: Path) -> str | None:
    """None for a complete checkpoint (manifest valid, sizes match), else why it is not."""
    try:
        read_manifest(folder, verify_hashes=False)
    except CheckpointError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------
# finding checkpoints
# --------------------------------------------------------------------------------------------


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``checkpoint-N`` folder in ``root``, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((step, p) for p in root.iterdir() if p.is_dir() and (step := checkpoint_step(p)) is not None)


def list_checkpoints(output_dir: str | os.PathLike, complete_only: bool = True) -> list[Path]:
    """``checkpoint-N`` folders in ``output_dir``, oldest step first (only complete ones by default)."""
    return [p for _, p in _step_folders(Path(output_dir)) if not complete_only or _incomplete_reason(p) is None]


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in ``output_dir``; temp and broken folders are skipped."""
    for _, path in reversed(_step_folders(Path(output_dir))):
        reason = _incomplete_reason(path)
        if reason is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, reason)
    return None


def resolve_checkpoint(spec: str | bool | os.PathLike | None, output_dir: str | os.PathLike) -> Path | None:
    """Turn ``resume_from_checkpoint`` into a validated folder: None/False → None, 'latest'/True → newest."""
    if spec is None or spec is False or spec == "":
        return None
    if spec is True or (isinstance(spec, str) and spec.strip().lower() == "latest"):
        latest = find_latest_checkpoint(output_dir)
        if latest is None:
            raise CheckpointError(
                f"resume_from_checkpoint='latest' but {str(output_dir)!r} has no complete "
                f"{CHECKPOINT_PREFIX}N folder; start without resume_from_checkpoint or give a checkpoint path"
            )
        return latest
    path = Path(spec)
    if not path.exists() and not path.is_absolute() and (Path(output_dir) / path).exists():
        path = Path(output_dir) / path
    read_manifest(path, verify_hashes=False)
    return path


def _require(folder: Path, manifest: Mapping[str, Any], name: str, what: str) -> Path:
    if name not in manifest["files"]:
        raise CheckpointError(
            f"{folder} has no {name}: it was saved without {what}, so {what} cannot be resumed from it; "
            f"resume without passing {what}, or use a checkpoint that has one"
        )
    return folder / name


def _prune(root: Path, keep: int, protect: Iterable[Path]) -> None:
    """Delete the oldest complete checkpoints beyond ``keep``; never those in ``protect``."""
    protect = {Path(p) for p in protect}
    complete = list_checkpoints(root)
    excess = len(complete) - keep
    for path in complete:
        if excess <= 0:
            break
        if path in protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.info("deleted old checkpoint %s (save_total_limit=%d)", path, keep)
        excess -= 1


def _clean_leftovers(root: Path, keep: Iterable[Path]) -> None:
    """Put back checkpoints a crashed swap moved aside, then remove temp/trash folders of crashed saves.

    Only one process saves per output_dir, so every such folder not in ``keep`` is a leftover.
    """
    io.restore_interrupted_swaps(root)
    keep = set(keep)
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and path not in keep:
            shutil.rmtree(path, ignore_errors=True)
