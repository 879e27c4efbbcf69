"""Supervisor process of one sandboxed run (stdlib only; started by sandbox.py as a script).

It isolates itself (new network namespace when allowed, then the sandbox uid when started as
root), reports what it achieved on the status pipe, forks the child that applies the resource
limits and execs ``python -I main.py``, waits for it, kills every leftover process of the sandbox
uid (descendants that left the process group), and reports the exit status. The child's parent
is this process, never the trainer, so ``os.kill(os.getppid(), 9)`` only ends the supervisor.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_CHILD_SUBREAPER = 36


def _unshare(flags):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(flags) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _isolate_network(as_root):
    """Detach from all network interfaces; returns (isolated, how or why not)."""
    error = _unshare(CLONE_NEWNET)
    if error is None:
        return True, "network namespace"
    if not as_root:
        # Unprivileged: a user namespace grants the capability to make a network namespace.
        error_user = _unshare(CLONE_NEWUSER | CLONE_NEWNET)
        if error_user is None:
            return True, "user + network namespace"
        return False, f"unshare failed: {error}; with a user namespace: {error_user}"
    return False, f"unshare failed: {error}"


def _count_user_processes(uid):
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def _limit(which, value, hard_extra=0):
    try:
        resource.setrlimit(which, (value, value + hard_extra))
    except (ValueError, OSError):
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            resource.setrlimit(which, (min(value, hard), hard))


def _child(config):
    limits = config["limits"]
    os.setpgid(0, 0)  # the program's own process group, so the supervisor can kill it and survive
    _limit(resource.RLIMIT_CORE, 0)
    # Soft limit sends SIGXCPU (reported as the CPU limit); the hard one a second later, SIGKILL.
    _limit(resource.RLIMIT_CPU, int(limits["cpu_seconds"]), hard_extra=1)
    _limit(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    _limit(resource.RLIMIT_FSIZE, int(limits["file_size_bytes"]))
    nproc = int(limits["max_processes"])
    # Same uid as the trainer: RLIMIT_NPROC counts all of that user's processes, so allow those too.
    nproc += config["existing_processes"]
    _limit(resource.RLIMIT_NPROC, nproc)
    python = config["python"]
    os.execve(python, [python, "-I", "-B", config["script"]], config["env"])


def _wait(pid, timeout):
    """Wait for the child until it exits, the wall-clock ``timeout`` passes or SIGTERM arrives (the
    trainer's request to stop it); returns (wait status, None or why it was stopped)."""
    requested = []
    signal.signal(signal.SIGTERM, lambda *_: requested.append("terminated"))
    deadline = time.monotonic() + timeout
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            return wait_status, None
        if requested or time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, requested[0] if requested else "timeout"
        time.sleep(0.01)


def _reap(grace):
    """Collect exited descendants (orphans come here: this is their subreaper) for up to ``grace``
    seconds; processes that left the program's group and are still running are not waited for."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def main():
    config = json.loads(sys.argv[1])
    status = os.fdopen(config["status_fd"], "w")
    report = {"as_root": os.geteuid() == 0}
    uid = config["uid"]
    config["existing_processes"] = 0 if uid is not None else _count_user_processes(os.getuid())
    if config["network"]:
        report["network_isolated"], report["network"] = False, "allowed by configuration"
    else:
        report["network_isolated"], report["network"] = _isolate_network(report["as_root"])
    if uid is not None:
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(uid)
    report["uid"] = os.getuid()
    status.write(json.dumps(report) + "\n")
    status.flush()
    # Orphaned descendants are re-parented here (not to the container's init) so they can be reaped.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    pid = os.fork()
    if pid == 0:
        status.close()
        try:
            _child(config)
        except BaseException as exc:  # exec failed: say why on the program's stderr
            sys.stderr.write(f"sandbox: could not start Python: {type(exc).__name__}: {exc}\n")
            sys.stderr.flush()
        os._exit(127)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # the child did it first (or already exited)
    status.write(json.dumps({"child": pid}) + "\n")
    status.flush()
    wait_status, stopped = _wait(pid, config["timeout"])
    try:
        os.killpg(pid, signal.SIGKILL)  # what the program left running in its group
    except OSError:
        pass
    if uid is not None:
        # Every process of the sandbox uid but this one: children that escaped the process group.
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    _reap(grace=2.0 if uid is not None else 0.5)
    if stopped is not None:
        status.write(json.dumps({"stopped": stopped}) + "\n")
    elif os.WIFSIGNALED(wait_status):
        status.write(json.dumps({"signal": os.WTERMSIG(wait_status)}) + "\n")
    else:
        status.write(json.dumps({"exit_code": os.WEXITSTATUS(wait_status)}) + "\n")
    status.flush()


if __name__ == "__main__":
    main()
