"""The built-in models' cache: where builds live, the lock that makes parallel builders build once, and the
atomic write that never leaves a half-written folder behind. Shared by the text and the vision-language builds."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_dir() -> Path:
    """Where built models live: ``$GRPO_ASCEND_CACHE`` or ``~/.cache/grpo_ascend``."""
    root = os.environ.get("GRPO_ASCEND_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "grpo_ascend"
    )
    return Path(root) / "tiny-models"


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock for building ``target``: a second process asking for the same model
    (parallel test workers, two runs starting together) waits for the first build instead of repeating it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builds still end in one atomic rename, just duplicated work
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_atomically(target: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write`` on a temporary folder next to ``target``, then rename it into place (replacing any old one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
