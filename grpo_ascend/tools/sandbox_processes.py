"""The sandbox's process hygiene: uids per concurrent call, a clean environment, killing a call's
process group and anything its uid or mount namespace left running."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

#: Sandbox uids used when running as root: a block per trainer process, a slot per concurrent call.
_UID_BASE = 2_000_000
_UID_SLOTS = 64


def signal_name(number: int | None) -> str:
    try:
        return signal.Signals(number).name if number is not None else "?"
    except ValueError:
        return f"signal {number}"


class UidSlots:
    """Sandbox uids of this process when running as root; blocks when all slots are busy."""

    def __init__(self) -> None:
        self._free = list(range(_UID_SLOTS))
        self._cond = threading.Condition()

    def acquire(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            slot = self._free.pop(0)  # least recently used: a slot's leftovers have longest to go
        return _UID_BASE + (os.getpid() % 30_000) * _UID_SLOTS + slot

    def release(self, uid: int) -> None:
        with self._cond:
            self._free.append((uid - _UID_BASE) % _UID_SLOTS)
            self._cond.notify()


SLOTS = UidSlots()


def clean_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(proc: subprocess.Popen) -> None:
    """Ask the supervisor to kill the program, sweep and report (it then exits on its own)."""
    try:
        proc.send_signal(signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def kill_leftovers(uid: int | None, mount_namespace: int | None, grace: float = 0.3) -> None:
    """Kill every process of the sandbox ``uid`` (as root) or in the call's own ``mount_namespace``,
    for when the supervisor could not do it (it was killed or stopped by the program)."""
    if uid is None and mount_namespace is None:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if uid is not None:
                    match = os.stat(f"/proc/{entry}").st_uid == uid
                else:
                    match = os.stat(f"/proc/{entry}/ns/mnt").st_ino == mount_namespace
                if match and not is_zombie(entry):
                    os.kill(int(entry), signal.SIGKILL)
                    found = True
            except OSError:
                pass
        if not found:
            return
        time.sleep(0.005)


def is_zombie(pid: str) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"Z"
