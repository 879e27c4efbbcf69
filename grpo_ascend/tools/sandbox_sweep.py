"""Removing what a sandbox uid left in world-writable places after its call.

Where the kernel gives the call no private scratch space (no mount namespace), its files in /tmp,
/var/tmp, /dev/shm and the like outlive it. When the trainer runs as root each call has its own
uid, so every file that uid owns there is the call's and can be removed once its processes are dead.
"""

from __future__ import annotations

import os
import shutil
import stat

#: Folders any user may write to on a usual Linux system (those that exist are swept).
WORLD_WRITABLE_PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")


def sweep_uid_files(uid: int, places: tuple[str, ...] = WORLD_WRITABLE_PLACES) -> int:
    """Remove every file and folder owned by ``uid`` under ``places``, looking inside other users'
    folders only where they are world-writable; returns how many entries were removed. Call it
    only when no process of ``uid`` is left, or new files may appear behind it."""
    removed = 0
    seen: set[str] = set()
    for place in places:
        real = os.path.realpath(place)
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        removed += _sweep_folder(real, uid)
    return removed


def _sweep_folder(folder: str, uid: int) -> int:
    removed = 0
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if info.st_uid == uid:
            removed += 1
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except OSError:
                    removed -= 1
        elif stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
            removed += _sweep_folder(entry.path, uid)
    return removed
