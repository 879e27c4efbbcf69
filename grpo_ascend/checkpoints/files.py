"""Durable files for checkpoints and exports: atomic folders, fsync, manifests with sha256, safe readers.

:class:`AtomicFolder` builds a folder under a hidden temporary sibling name
(``.tmp-{name}-XXXX``), fsyncs every file and folder in it, and only then renames it to its final
name; an existing folder of that name is moved aside (``.trash-{name}-...``) first and deleted
after. A crash at any moment therefore leaves either the old folder or the new one, never a mix,
and a body that raises leaves the old folder as it was.

A manifest (``manifest.json``) lists every other file of a folder with its size and sha256;
:func:`check_manifest_files` verifies a folder against it. Tensors are written with safetensors
and everything else is read with ``torch.load(weights_only=True)``; every reader turns a missing or
damaged file into a :class:`~grpo_ascend.errors.CheckpointError` that names the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from grpo_ascend.errors import CheckpointError

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
MANIFEST_NAME = "manifest.json"
_HASH_CHUNK = 8 * 1024 * 1024


# --------------------------------------------------------------------------------------------
# fsync and hashes
# --------------------------------------------------------------------------------------------


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to disk."""
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a folder's entries (a rename or new file) on POSIX; other systems cannot open folders."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """Flush every file under ``folder``, then every folder, deepest first."""
    root = Path(folder)
    folders = {root}
    for path in root.rglob("*"):
        if path.is_file():
            fsync_file(path)
            folders.add(path.parent)
        elif path.is_dir():
            folders.add(path)
    for sub in sorted(folders, key=lambda p: -len(p.parts)):
        fsync_dir(sub)


def sha256_file(path: str | os.PathLike) -> str:
    """The file's sha256 as hex, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# readers and writers
# --------------------------------------------------------------------------------------------


def write_json(path: str | os.PathLike, data: Any, what: str) -> None:
    """Write ``data`` as indented, key-sorted JSON; ``what`` names it in the error for unserialisable data."""
    path = Path(path)
    try:
        text = json.dumps(data, indent=2, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot save {what} to {path.name}: it must be JSON-serialisable (plain dicts, lists, str, "
            f"numbers, bools, None), but {exc}; convert tensors with .tolist() or .item() first"
        ) from exc
    path.write_text(text + "\n", encoding="utf-8")


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; a missing or malformed one is a CheckpointError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is not valid JSON ({exc}); the file is damaged") from exc


def save_tensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write name → tensor to a safetensors file (detached, contiguous CPU copies; no shared storage)."""
    out = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"tensors to save must be a dict of str -> torch.Tensor, got {type(name).__name__} -> "
                f"{type(tensor).__name__} for key {name!r}"
            )
        out[name] = tensor.detach().to("cpu", copy=True).contiguous()
    save_file(out, str(path), {"format": "pt"})


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a safetensors file onto the CPU; a missing, truncated or damaged file is a CheckpointError."""
    path = Path(path)
    try:
        return load_file(str(path), device="cpu")
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is not a readable safetensors file ({exc}); it is truncated or "
            f"damaged: resume from an earlier checkpoint"
        ) from exc


def torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` for state dicts of plain tensors and Python values (readable by :func:`torch_load`)."""
    torch.save(obj, path)


def torch_load(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU: no code from the file runs; errors name the file."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from exc
    except Exception as exc:  # unpickling errors have many types; all mean the same to the user
        raise CheckpointError(
            f"checkpoint file {str(path)!r} cannot be read with torch.load(weights_only=True) "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); it is damaged or was "
            f"not written by grpo-ascend"
        ) from exc


# --------------------------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------------------------


def write_manifest(folder: str | os.PathLike, header: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``folder/manifest.json``: ``header`` plus ``files`` (size and sha256 of every other file).

    Write it last, once every other file is in place; returns the manifest.
    """
    root = Path(folder)
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        files[path.relative_to(root).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {**header, "files": files}
    write_json(root / MANIFEST_NAME, manifest, "the manifest")
    return manifest


def check_manifest_files(folder: str | os.PathLike, files: Mapping[str, Any], verify_hashes: bool = True) -> None:
    """Check that every file listed in a manifest's ``files`` exists with its size (and sha256).

    Raises CheckpointError naming the first missing, truncated or damaged file.
    """
    root = Path(folder)
    for rel, info in files.items():
        file = root / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing (listed in {MANIFEST_NAME})")
        size = file.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is truncated or altered: {size} bytes, expected {info['size']}; "
                f"use an earlier checkpoint"
            )
        if verify_hashes and sha256_file(file) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is damaged: its sha256 does not match {MANIFEST_NAME}; "
                f"use an earlier checkpoint"
            )


# --------------------------------------------------------------------------------------------
# atomic folder
# --------------------------------------------------------------------------------------------


def make_staging_dir(target: str | os.PathLike) -> Path:
    """Create the hidden temporary sibling ``.tmp-{name}-XXXX`` that ``target`` is built in."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))


def is_staging_dir_of(staging: str | os.PathLike, target: str | os.PathLike) -> bool:
    """Whether ``staging`` is a folder :func:`make_staging_dir` made for ``target``."""
    staging, target = Path(staging), Path(target)
    return (
        staging.is_dir()
        and staging.parent.resolve() == target.parent.resolve()
        and staging.name.startswith(f"{TMP_PREFIX}{target.name}-")
    )


def _trash_target(name: str) -> str | None:
    """The folder name a ``.trash-{name}-{pid}-{ns}`` folder was moved aside from, or None."""
    if not name.startswith(TRASH_PREFIX):
        return None
    parts = name[len(TRASH_PREFIX):].rsplit("-", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else None


def restore_interrupted_swaps(parent: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Rename back every moved-aside folder whose replacement never arrived; returns the restored paths.

    A crash between the two renames of an :class:`AtomicFolder` swap leaves the old folder under its
    ``.trash-`` name and no folder under the final name; this puts the old one back. ``name``: only
    the folder of that name (default: every folder in ``parent``).
    """
    restored = []
    root = Path(parent)
    if not root.is_dir():
        return restored
    for path in sorted(root.iterdir()):
        moved_from = _trash_target(path.name)
        if moved_from is None or not path.is_dir() or (name is not None and moved_from != name):
            continue
        final = root / moved_from
        if not final.exists():
            os.replace(path, final)
            fsync_dir(root)
            restored.append(final)
    return restored


class AtomicFolder:
    """Build ``target`` in a temporary sibling; swap it in whole on success, remove it on failure.

    ``with AtomicFolder(target) as tmp:`` yields the folder to write into. When the body raises
    (KeyboardInterrupt included) the temporary folder is deleted and an existing ``target`` is
    untouched. On success every file and folder is fsynced, an existing ``target`` is moved aside,
    the new folder renamed into place, the parent fsynced and the old folder deleted; if the swap
    itself fails, the old folder is put back. ``staging``: a folder from :func:`make_staging_dir`
    that others already wrote into (e.g. every rank's optimizer shard), used instead of a new one.
    """

    def __init__(self, target: str | os.PathLike, staging: str | os.PathLike | None = None):
        self.target = Path(target)
        if staging is not None and not is_staging_dir_of(staging, self.target):
            raise CheckpointError(
                f"staging folder {str(staging)!r} was not made by make_staging_dir for {str(self.target)!r}"
            )
        self._staging = Path(staging) if staging is not None else None
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        restore_interrupted_swaps(self.target.parent, self.target.name)
        self.tmp = self._staging if self._staging is not None else make_staging_dir(self.target)
        return self.tmp

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        trash = None
        try:
            fsync_tree(self.tmp)
            if self.target.exists():
                trash = self.target.parent / f"{TRASH_PREFIX}{self.target.name}-{os.getpid()}-{time.time_ns()}"
                os.replace(self.target, trash)
            os.replace(self.tmp, self.target)
            fsync_dir(self.target.parent)
        except BaseException:
            if trash is not None and not self.target.exists():
                os.replace(trash, self.target)
                trash = None
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
