"""One cgroup per sandboxed call: caps the memory and the number of processes of the call as a
whole (every process it forks, and the tmpfs pages it writes), and kills all of them at the end.

cgroup v2 is tried first (``memory.max``, ``memory.swap.max``, ``pids.max`` in a child of the
trainer's own group), then the v1 ``memory`` and ``pids`` hierarchies. Creating a group needs write
access to the trainer's cgroup, which in practice means running as root (or a delegated subtree);
:func:`create_call_group` says why when it cannot.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_COUNTER = itertools.count()
_PREFIX = "grpo-sandbox-"
_CLEANED: set[Path] = set()


@dataclass(frozen=True)
class CallGroup:
    """The cgroup(s) of one call: one directory on v2, a ``memory`` and a ``pids`` one on v1."""

    mechanism: str  # "cgroup2" or "cgroup1"
    dirs: tuple[Path, ...]
    memory_bytes: int
    max_processes: int

    @property
    def procs_files(self) -> list[str]:
        """Files a process writes its pid to in order to join the group."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return found

    def kill(self, timeout: float = 1.0) -> bool:
        """SIGKILL every process in the group until it is empty; True when it is."""
        killer = self.dirs[0] / "cgroup.kill"
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            if killer.exists():
                _write(killer, "1")
            else:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.005)

    def peak_bytes(self) -> int | None:
        """Most memory the call held at once (None where the kernel does not say)."""
        name = "memory.peak" if self.mechanism == "cgroup2" else "memory.max_usage_in_bytes"
        try:
            return int((self.dirs[0] / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int | None:
        """Processes of the call the OOM killer ended because the group hit its cap."""
        name = "memory.events" if self.mechanism == "cgroup2" else "memory.oom_control"
        try:
            fields = dict(line.split() for line in (self.dirs[0] / name).read_text().splitlines())
            return int(fields["oom_kill"])
        except (OSError, ValueError, KeyError):
            return None

    def remove(self, timeout: float = 0.5) -> bool:
        """Remove the (empty) group; a just-killed process may take a moment to leave it."""
        deadline = time.monotonic() + timeout
        left = list(self.dirs)
        while left:
            try:
                left[0].rmdir()
                left.pop(0)
            except FileNotFoundError:
                left.pop(0)
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
        return True


def create_call_group(memory_bytes: int, max_processes: int) -> tuple[CallGroup | None, str]:
    """A new group capped at ``memory_bytes`` and ``max_processes``, or None and why not."""
    name = f"{_PREFIX}{os.getpid()}-{next(_COUNTER)}"
    reasons = []
    for make in (_make_v2, _make_v1):
        try:
            return make(name, memory_bytes, max_processes), ""
        except OSError as exc:
            reasons.append(f"{make.__doc__}: {exc.strerror or exc}")
    return None, "; ".join(reasons)


def _make_v2(name: str, memory_bytes: int, max_processes: int) -> CallGroup:
    """cgroup v2"""
    own = _own_group("cgroup2", None)
    parent = None
    if {"memory", "pids"} <= _enabled_for_children(own):
        parent = own
    elif {"memory", "pids"} <= _enabled_for_children(own.parent):
        parent = own.parent  # a sibling of the trainer's group, as under systemd's slices
    else:
        available = set((own / "cgroup.controllers").read_text().split())
        if not {"memory", "pids"} <= available:
            raise OSError(f"no memory and pids controllers in {own} (it has: {' '.join(sorted(available))})")
        # Fails (EBUSY) when the trainer's group holds processes, as it does unless it is the root.
        _write(own / "cgroup.subtree_control", "+memory +pids")
        parent = own
    _remove_stale_groups(parent)
    group = parent / name
    group.mkdir()
    try:
        _write(group / "memory.max", str(memory_bytes))
        if (group / "memory.swap.max").exists():
            _write(group / "memory.swap.max", "0")
        _write(group / "pids.max", str(max_processes))
    except OSError:
        group.rmdir()
        raise
    return CallGroup("cgroup2", (group,), memory_bytes, max_processes)


def _make_v1(name: str, memory_bytes: int, max_processes: int) -> CallGroup:
    """cgroup v1"""
    memory = _own_group("cgroup", "memory") / name
    pids = _own_group("cgroup", "pids") / name
    made: list[Path] = []
    try:
        for group in (memory, pids):
            _remove_stale_groups(group.parent)
            group.mkdir()
            made.append(group)
        _write(memory / "memory.limit_in_bytes", str(memory_bytes))
        try:  # memory + swap, where swap accounting is on
            _write(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))
        except OSError:
            pass
        _write(pids / "pids.max", str(max_processes))
    except OSError:
        for group in reversed(made):
            group.rmdir()
        raise
    return CallGroup("cgroup1", (memory, pids), memory_bytes, max_processes)


def _own_group(fstype: str, controller: str | None) -> Path:
    """Directory of this process's group in the hierarchy of ``fstype`` (with ``controller`` on v1)."""
    path = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, group = line.split(":", 2)
        names = controllers.split(",") if controllers else []
        if (controller is None and controllers == "") or (controller is not None and controller in names):
            path = group
    if path is None:
        raise OSError(f"no {controller or 'unified'} hierarchy in /proc/self/cgroup")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        parts, options = fields.split(), rest.split()
        if len(options) < 3 or options[0] != fstype:
            continue
        if controller is not None and controller not in options[2].split(","):
            continue
        root, mount_point = parts[3], parts[4]
        relative = path[len(root) :] if root != "/" and path.startswith(root) else path
        directory = Path(mount_point + relative.rstrip("/"))
        if directory.is_dir():
            return directory
    raise OSError(f"no mounted {fstype} {controller or ''} hierarchy holding {path}")


def _remove_stale_groups(parent: Path) -> None:
    """Once per process and place: remove the (empty) groups of trainer processes that died
    during a call and so could not remove their own."""
    if parent in _CLEANED:
        return
    _CLEANED.add(parent)
    for group in parent.glob(f"{_PREFIX}*-*"):
        pid = group.name[len(_PREFIX) :].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                group.rmdir()
            except OSError:
                pass  # still holds processes


def _enabled_for_children(group: Path) -> set[str]:
    try:
        return set((group / "cgroup.subtree_control").read_text().split())
    except OSError:
        return set()


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
