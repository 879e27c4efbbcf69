"""Sandboxed Python execution: the built-in ``python`` tool and a runner for code-task rewards.

Each call runs ``python -I main.py`` under a supervisor process in its own session
(``_sandbox_launcher.py``), with a clean environment and:

- a wall-clock timeout; the call returns within a second of it whatever the program spawned, and
  every process it started is killed (its group, every descendant, the call's cgroup, the sandbox
  uid's processes as root, the call's mount namespace otherwise);
- ``resource`` limits on CPU seconds, address space, file size and number of processes;
- a cgroup per call where the trainer may make one (:mod:`.sandbox_cgroup`): ``memory_bytes`` and
  ``max_processes`` then cap the call as a whole; otherwise ``max_processes`` is lowered so that
  ``max_processes x memory_bytes`` fits in the memory available;
- ``oom_score_adj`` 1000, so the OOM killer takes sandboxed code before the trainer;
- a private tmpfs of ``scratch_bytes`` behind /tmp, /var/tmp, /dev/shm and the working folder, in a
  mount namespace (as root, or through a user namespace), gone with the call; where that fails and
  the trainer is root, every file of the call's uid in world-writable places is removed afterwards
  (:mod:`.sandbox_sweep`);
- stdout/stderr kept up to ``max_output_bytes`` each; a program printing more than
  ``output_kill_bytes`` in total is stopped;
- no network where the kernel allows a network namespace;
- as root, a dedicated unprivileged uid per concurrent call (``RLIMIT_NPROC`` is only enforced
  for non-root users, and per user), so the code cannot signal the trainer or write its files.

``SandboxResult.isolation`` says which of these held. What is NOT isolated (no seccomp, no PID
namespace): the code can read every world-readable file outside the scratch places, and when the
trainer is not root it runs as the trainer's user and could signal the trainer's processes by pid.
Use a container or VM for untrusted code beyond model-written snippets.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from grpo_ascend.errors import ConfigError
from grpo_ascend.tools import sandbox_processes as hygiene
from grpo_ascend.tools.sandbox_cgroup import CallGroup, create_call_group
from grpo_ascend.tools.sandbox_sweep import WORLD_WRITABLE_PLACES, sweep_uid_files

logger = logging.getLogger(__name__)

_LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))
#: Seconds past the timeout after which the trainer kills the supervisor's group itself (the
#: clean-up after it fits in the rest of the second the call may outlive its timeout by).
_BACKSTOP_S = 0.5


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. Sizes in bytes, times in seconds."""

    timeout: float = 10.0
    cpu_seconds: int = 10
    #: Address space per process and, where a cgroup for the call holds, the resident memory of the
    #: whole call (all its processes and its scratch tmpfs).
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    #: Processes of the call (its supervisor included).
    max_processes: int = 32
    #: Size of the call's private tmpfs behind /tmp, /var/tmp, /dev/shm and its working folder.
    scratch_bytes: int = 64 << 20
    max_output_bytes: int = 8192
    output_kill_bytes: int = 1 << 20
    network: bool = False
    #: Interpreter running the code (default: this one; as root, the first of this one and the
    #: system ``python3`` that the unprivileged sandbox uid can execute).
    interpreter: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "timeout",
            "cpu_seconds",
            "memory_bytes",
            "file_size_bytes",
            "max_processes",
            "scratch_bytes",
            "max_output_bytes",
            "output_kill_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"sandbox limit {name} must be a positive number; got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What happened. ``status``: ``ok`` (exit 0), ``error`` (non-zero exit, e.g. an exception or a
    syntax error), ``timeout`` (wall clock), ``cpu_limit``, ``killed`` (by a signal),
    ``output_limit`` or ``supervisor_killed`` (the code killed its supervising parent)."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None = None
    signal: int | None = None
    duration: float = 0.0
    truncated: bool = False
    isolation: dict[str, Any] = field(default_factory=dict)
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def message(self) -> str:
        """The text returned to the model: the output, and what went wrong when something did."""
        out = self.stdout
        if self.stderr:
            out = f"{out}\n{self.stderr}" if out else self.stderr
        note = {
            "ok": "",
            "error": f"Error: the program exited with code {self.exit_code}.",
            "timeout": f"Error: the program did not finish within {self.limits.timeout:g} s and was killed.",
            "cpu_limit": f"Error: the program used more than {self.limits.cpu_seconds} s of CPU time and was killed.",
            "killed": f"Error: the program was killed by signal {self.signal} ({hygiene.signal_name(self.signal)}).",
            "output_limit": (
                f"Error: the program printed more than {self.limits.output_kill_bytes} bytes and was stopped."
            ),
            "supervisor_killed": "Error: the program killed its supervising process and was stopped.",
        }[self.status]
        if self.status == "killed" and self.signal == signal.SIGKILL and self.isolation.get("oom_kills"):
            note = (
                f"Error: the program ran out of memory ({self.limits.memory_bytes} bytes for the whole run) "
                "and was killed."
            )
        if self.truncated and self.status != "output_limit":
            note = f"{note} (output truncated to {self.limits.max_output_bytes} bytes per stream)".strip()
        if not out.strip() and not note:
            return "(no output)"
        return f"{out.rstrip()}\n{note}".strip() if note else out.rstrip()


_USABLE: dict[str, bool] = {}
_USABLE_LOCK = threading.Lock()


def _interpreter(configured: str | None, uid: int | None) -> str | None:
    """The interpreter for a run as ``uid``: None when, as root, none is executable by the sandbox uid
    (e.g. a virtualenv under /root), in which case the run keeps root's uid and says so."""
    if uid is None:
        return configured or sys.executable
    candidates = (
        [configured] if configured else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    )
    for path in candidates:
        with _USABLE_LOCK:
            if path not in _USABLE:
                _USABLE[path] = os.path.exists(path) and _probe(path, uid)
                if not _USABLE[path]:
                    logger.warning(
                        "sandbox: %s cannot be run by an unprivileged uid (a virtualenv under /root?); "
                        "trying the next interpreter, without this one's packages",
                        path,
                    )
            if _USABLE[path]:
                return path
    logger.warning(
        "sandbox: no interpreter runs under an unprivileged uid; sandboxed code keeps root's uid. Give the "
        "sandbox one outside /root, e.g. SandboxLimits(interpreter='/opt/sandbox-venv/bin/python') "
        "(docs/tools.md, 'An interpreter for the sandbox')"
    )
    return None


def _probe(interpreter: str, uid: int) -> bool:
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-probe-")
    try:
        script = os.path.join(workdir, "main.py")
        with open(script, "w") as f:
            f.write("print('ok')")
        os.chown(workdir, uid, uid)
        os.chown(script, uid, uid)
        limits = SandboxLimits(timeout=20)
        result = _supervise(workdir, uid, limits, None, interpreter, None, limits.max_processes)
        return result.ok and result.stdout.strip() == "ok"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_python(code: str, limits: SandboxLimits | None = None, stdin: str | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter and report the outcome (never raises for bad code)."""
    limits = limits or SandboxLimits()
    as_root = os.geteuid() == 0
    uid = hygiene.SLOTS.acquire() if as_root else None
    interpreter = _interpreter(limits.interpreter, uid)
    if interpreter is None:
        hygiene.SLOTS.release(uid)
        uid = None
        interpreter = limits.interpreter or sys.executable
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    group, no_group = create_call_group(limits.memory_bytes, limits.max_processes)
    processes = _processes_without_cgroup(limits)
    result = None
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, "main.py"), uid, uid)
        result = _supervise(workdir, uid, limits, stdin, interpreter, group, processes)
    finally:
        isolation = result.isolation if result is not None else {}
        joined = isolation.pop("cgroup_joined", False)
        if group is not None:
            group.kill()
            if joined:
                isolation.update(_memory_report(group, limits))
            group.remove()
        if not joined:
            why = no_group or isolation.pop("cgroup_error", "the supervisor did not start")
            isolation.update(_fallback_memory_report(limits, processes, why))
        shutil.rmtree(workdir, ignore_errors=True)
        if uid is not None:
            swept = sweep_uid_files(uid)
            isolation["swept"] = swept
            if isolation.get("scratch") == "shared":
                isolation["scratch"] = "sweep"
                isolation["scratch_note"] += (
                    f"; files of uid {uid} in {', '.join(WORLD_WRITABLE_PLACES)} removed after the call"
                )
            hygiene.SLOTS.release(uid)
        elif as_root:
            isolation["uid"] = "not dropped: no interpreter executable by an unprivileged uid"
    return result


def _processes_without_cgroup(limits: SandboxLimits) -> int:
    """``max_processes``, lowered so that as many processes of ``memory_bytes`` each fit in the
    memory the machine has available: the per-process limits' only bound on the call's total."""
    available = _available_memory()
    if available is None:
        return limits.max_processes
    return max(1, min(limits.max_processes, available // limits.memory_bytes))


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _memory_report(group: CallGroup, limits: SandboxLimits) -> dict[str, Any]:
    return {
        "memory": group.mechanism,
        "memory_note": (
            f"{limits.memory_bytes} bytes and {limits.max_processes} processes for the whole call "
            f"({group.mechanism} group), {limits.memory_bytes} bytes of address space per process"
        ),
        "max_processes": limits.max_processes,
        "memory_peak_bytes": group.peak_bytes(),
        "oom_kills": group.oom_kills(),
    }


def _fallback_memory_report(limits: SandboxLimits, processes: int, why: str) -> dict[str, Any]:
    lowered = (
        f", lowered from {limits.max_processes} to fit the available memory"
        if processes < limits.max_processes
        else ""
    )
    return {
        "memory": "rlimit",
        "memory_note": (
            f"{limits.memory_bytes} bytes of address space per process and at most {processes} processes"
            f"{lowered}; no cgroup for the call ({why})"
        ),
        "max_processes": processes,
    }


def _supervise(
    workdir: str,
    uid: int | None,
    limits: SandboxLimits,
    stdin: str | None,
    interpreter: str,
    group: CallGroup | None,
    processes_without_cgroup: int,
) -> SandboxResult:
    status_r, status_w = os.pipe()
    config = {
        "python": interpreter,
        "workdir": workdir,
        "env": hygiene.clean_env(workdir),
        "uid": uid,
        "gid": uid,
        "network": limits.network,
        "status_fd": status_w,
        "timeout": limits.timeout,
        "scratch_bytes": limits.scratch_bytes,
        "cgroup_procs": group.procs_files if group is not None else [],
        "max_processes_without_cgroup": processes_without_cgroup,
        "limits": {
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_bytes,
            "file_size_bytes": limits.file_size_bytes,
            "max_processes": limits.max_processes,
        },
    }
    start = time.monotonic()
    stdin_file = None
    if stdin is not None:
        # A file, not a pipe: a program that never reads its input cannot block the trainer.
        stdin_path = os.path.join(workdir, ".stdin")
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        stdin_file = open(stdin_path, "rb")  # closed right after Popen
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", _LAUNCHER, json.dumps(config)],
            stdin=stdin_file if stdin_file is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env=hygiene.clean_env(workdir),
            start_new_session=True,
            pass_fds=(status_w,),
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
        if stdin_file is not None:
            stdin_file.close()
    streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_r: "status"}
    kept: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
    printed = 0
    truncated = False
    stopped: str | None = None
    exited_at: float | None = None
    selector = selectors.DefaultSelector()
    for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
    try:
        while selector.get_map():
            now = time.monotonic()
            if now - start > limits.timeout + _BACKSTOP_S:
                stopped = "timeout"  # the supervisor did not stop it: it was killed or is stuck
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
                hygiene.kill_group(proc.pid)  # anything left in the group once the supervisor is gone
            if exited_at is not None and now - exited_at > 0.5:
                break  # a process outside the group holds the pipes open
            for key, _ in selector.select(timeout=0.05):
                data = os.read(key.fd, 65536)
                name = streams[key.fd]
                if not data:
                    selector.unregister(key.fd)
                    continue
                if name == "status":
                    kept[name] += data
                    continue
                printed += len(data)
                if stopped is not None:
                    continue
                room = limits.max_output_bytes - len(kept[name])
                if len(data) > room:
                    truncated = True
                kept[name] += data[: max(room, 0)]
            if printed > limits.output_kill_bytes and stopped is None:
                stopped = "output_limit"
                hygiene.terminate(proc)
    finally:
        selector.close()
        hygiene.kill_group(proc.pid)
        if group is not None:
            group.kill()  # the fastest way to end everything the call started
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        os.close(status_r)
    duration = time.monotonic() - start
    reports = [
        json.loads(line) for line in kept["status"].decode(errors="replace").splitlines() if line.strip()
    ]
    isolation = reports[0] if reports else {}
    child = next((r["child"] for r in reports if "child" in r), None)
    finished = next((r for r in reports if {"exit_code", "signal", "stopped"} & set(r)), None)
    if finished is None and child is not None:
        hygiene.kill_group(child)  # the supervisor died before killing the program's group
    if finished is None:  # the supervisor died or hung before it could kill the program's leftovers
        hygiene.kill_leftovers(uid, isolation.get("mount_namespace"))
    exit_code = finished.get("exit_code") if finished else None
    sig = finished.get("signal") if finished else None
    if stopped is None and finished is not None and "stopped" in finished:
        # "terminated" without our request: the program sent SIGTERM to its supervisor.
        stopped = "timeout" if finished["stopped"] == "timeout" else "supervisor_killed"
    if stopped is not None:
        status = stopped
    elif finished is None:
        status = "supervisor_killed"
    elif sig is not None:
        status = "cpu_limit" if sig == signal.SIGXCPU else "killed"
    else:
        status = "ok" if exit_code == 0 else "error"
    return SandboxResult(
        status=status,
        stdout=kept["stdout"].decode(errors="replace"),
        stderr=_clean_traceback(kept["stderr"].decode(errors="replace"), isolation.get("workdir", workdir)),
        exit_code=exit_code,
        signal=sig,
        duration=duration,
        truncated=truncated,
        isolation=isolation,
        limits=limits,
    )


def _clean_traceback(text: str, workdir: str) -> str:
    """Tracebacks name ``main.py`` instead of the temporary folder's path."""
    return text.replace(os.path.join(workdir, ""), "")


def make_python_tool(**limit_options: Any) -> Callable[[str], str]:
    """The ``python`` tool with the given :class:`SandboxLimits` fields (e.g. ``timeout=5``)."""
    try:
        limits = replace(SandboxLimits(), **limit_options)
    except TypeError as exc:
        valid = ", ".join(SandboxLimits.__dataclass_fields__)
        raise ConfigError(f"unknown option for the python tool ({exc}); valid options: {valid}") from exc

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it prints.

        Args:
            code: The complete Python program to run. Use print() to show results.
        """
        return run_python(code, limits).message()

    return python
