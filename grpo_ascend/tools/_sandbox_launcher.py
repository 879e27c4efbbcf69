"""Supervisor process of one sandboxed run (stdlib only; started by sandbox.py as a script).

It joins the call's cgroup when the trainer made one, makes itself (and so everything it starts)
the OOM killer's first choice, isolates itself (a private size-capped tmpfs on /tmp, /var/tmp and
/dev/shm in a new mount namespace, a new network namespace; as an unprivileged trainer through a
user namespace), drops to the sandbox uid when started as root, and reports what held on the status
pipe. It then forks the child that applies the resource limits and execs ``python -I main.py``,
waits for it, kills every process the program left (its group, the sandbox uid's processes, and
every descendant: orphans are re-parented here) and reports the exit status. The child's parent is
this process, never the trainer, so ``os.kill(os.getppid(), 9)`` only ends the supervisor.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_CHILD_SUBREAPER = 36
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
#: World-writable places that get the call's private tmpfs; /tmp last, as it may hold the staging mount.
SCRATCH_PLACES = ("/var/tmp", "/dev/shm", "/tmp")
OOM_SCORE_ADJ = 1000

_libc = ctypes.CDLL(None, use_errno=True)


def _errno_text():
    return os.strerror(ctypes.get_errno())


def _unshare(flags):
    if _libc.unshare(flags) != 0:
        return _errno_text()
    return None


def _encode(text):
    return text.encode() if text is not None else None


def _mount(source, target, fstype, flags, data):
    if _libc.mount(_encode(source), _encode(target), _encode(fstype), flags, _encode(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}: {_errno_text()}")


def _enter_user_namespace():
    """Unprivileged: a user namespace (same uid and gid inside) grants the capabilities needed to
    make mount and network namespaces; the program loses them when it execs as a non-root uid."""
    uid, gid = os.getuid(), os.getgid()
    error = _unshare(CLONE_NEWUSER)
    if error is not None:
        return error
    try:
        for path, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
    except OSError as exc:
        return f"user namespace id maps: {exc.strerror}"
    return None


def _isolate_network():
    """Detach from all network interfaces; returns (isolated, how or why not)."""
    error = _unshare(CLONE_NEWNET)
    if error is None:
        return True, "network namespace"
    return False, f"unshare(CLONE_NEWNET) failed: {error}"


def _private_scratch(config, uid):
    """Mount one tmpfs of ``scratch_bytes`` in a new mount namespace and bind a folder of it onto
    each world-writable place, so the call's scratch files share one cap and vanish with the
    namespace. The program's working folder is made on it too. Returns the working folder."""
    python = os.path.realpath(config["python"])
    places = []
    for place in SCRATCH_PLACES:
        if os.path.isdir(place) and not os.path.islink(place):
            if python.startswith(place + "/"):
                raise OSError(f"the interpreter {config['python']} lives under {place}")
            places.append(place)
    with open(os.path.join(config["workdir"], "main.py"), encoding="utf-8") as f:
        code = f.read()
    error = _unshare(CLONE_NEWNS)
    if error is not None:
        raise OSError(f"unshare(CLONE_NEWNS) failed: {error}")
    # Private propagation first: without it the tmpfs would appear in the trainer's namespace.
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None)
    size = int(config["scratch_bytes"])
    inodes = max(256, size // 16384)  # inodes cost kernel memory too
    staging = config["workdir"]  # the trainer's folder: exists, and only this namespace sees the mount
    mounted = []
    try:
        _mount("tmpfs", staging, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={inodes},mode=0755")
        mounted.append(staging)
        staging_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for place in places:
                name = place.strip("/").replace("/", "_")
                os.mkdir(name, 0o755, dir_fd=staging_fd)
                os.chmod(f"/proc/self/fd/{staging_fd}/{name}", 0o1777)
                _mount(f"/proc/self/fd/{staging_fd}/{name}", place, None, MS_BIND, None)
                mounted.append(place)
        finally:
            os.close(staging_fd)
        workdir = os.path.join("/tmp", os.path.basename(config["workdir"]))
        os.mkdir(workdir, 0o700)
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, config["gid"])
            os.chown(script, uid, config["gid"])
    except OSError:
        for target in reversed(mounted):  # back to the shared places and the trainer's folder
            _libc.umount2(_encode(target), MNT_DETACH)
        raise
    return workdir


def _isolate(config, report):
    """Namespaces: scratch space and network, as far as the kernel allows; fills ``report``."""
    as_root = report["as_root"]
    uid = config["uid"]
    prefix = ""
    if not as_root:
        error = _enter_user_namespace()
        prefix = f"user namespace failed: {error}; " if error is not None else "user + "
        report["user_namespace"] = error is None
    workdir = config["workdir"]
    try:
        workdir = _private_scratch(config, uid)
        report["scratch"] = "tmpfs"
        report["mount_namespace"] = os.stat("/proc/self/ns/mnt").st_ino  # the call's alone
        report["scratch_note"] = f"private tmpfs of {config['scratch_bytes']} bytes ({prefix}mount namespace)"
    except OSError as exc:
        report["scratch"], report["scratch_note"] = "shared", f"{prefix}{exc.strerror or exc}"
    if config["network"]:
        report["network_isolated"], report["network"] = False, "allowed by configuration"
    else:
        isolated, how = _isolate_network()
        report["network_isolated"], report["network"] = isolated, f"{prefix}{how}"
    report["workdir"] = workdir
    return workdir


def _join_cgroup(config, report):
    """Move this process (and so everything it forks) into the call's cgroup."""
    try:
        for procs in config["cgroup_procs"]:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return True
    except OSError as exc:
        report["cgroup_error"] = f"could not join {procs}: {exc.strerror}"
        return False


def _set_oom_score_adj(report):
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
        with open("/proc/self/oom_score_adj") as f:
            report["oom_score_adj"] = int(f.read())
    except OSError as exc:
        report["oom_score_adj"] = f"not set: {exc.strerror}"


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


def _child(config, workdir):
    limits = config["limits"]
    os.setpgid(0, 0)  # the program's own process group, so the supervisor can kill it and survive
    os.chdir(workdir)
    _limit(resource.RLIMIT_CORE, 0)
    # Soft limit sends SIGXCPU (reported as the CPU limit); the hard one a second later, SIGKILL.
    _limit(resource.RLIMIT_CPU, int(limits["cpu_seconds"]), hard_extra=1)
    _limit(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    _limit(resource.RLIMIT_FSIZE, int(limits["file_size_bytes"]))
    nproc = int(limits["max_processes"])
    # Same uid as the trainer: RLIMIT_NPROC counts all of that user's processes, so allow those too.
    nproc += config["existing_processes"]
    _limit(resource.RLIMIT_NPROC, nproc)
    env = dict(config["env"], HOME=workdir, TMPDIR=workdir)
    python = config["python"]
    os.execve(python, [python, "-I", "-B", os.path.join(workdir, "main.py")], env)


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


def _descendants(root):
    """Pids of every process below ``root`` (orphans of the program are re-parented to ``root``)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _kill_descendants(grace):
    """Kill and reap every descendant, including ones that left the program's process group and
    session, for up to ``grace`` seconds."""
    me = os.getpid()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        pids = _descendants(me)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        time.sleep(0.005)


def main():
    config = json.loads(sys.argv[1])
    status = os.fdopen(config["status_fd"], "w")
    report = {"as_root": os.geteuid() == 0}
    if config["cgroup_procs"] and _join_cgroup(config, report):
        report["cgroup_joined"] = True
    else:
        report["cgroup_joined"] = False
        config["limits"]["max_processes"] = config["max_processes_without_cgroup"]
    _set_oom_score_adj(report)
    uid = config["uid"]
    config["existing_processes"] = 0 if uid is not None else _count_user_processes(os.getuid())
    workdir = _isolate(config, report)
    if report.get("user_namespace"):
        # RLIMIT_NPROC counts per user namespace: here only the call's own processes.
        config["existing_processes"] = 0
    if uid is not None:
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(uid)
    report["uid"] = os.getuid()
    status.write(json.dumps(report) + "\n")
    status.flush()
    # Orphaned descendants are re-parented here (not to the container's init) so they can be killed.
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    pid = os.fork()
    if pid == 0:
        status.close()
        try:
            _child(config, workdir)
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
        # Every process of the sandbox uid but this one, wherever it is in the process tree.
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
    _kill_descendants(grace=0.5)
    if stopped is not None:
        status.write(json.dumps({"stopped": stopped}) + "\n")
    elif os.WIFSIGNALED(wait_status):
        status.write(json.dumps({"signal": os.WTERMSIG(wait_status)}) + "\n")
    else:
        status.write(json.dumps({"exit_code": os.WEXITSTATUS(wait_status)}) + "\n")
    status.flush()


if __name__ == "__main__":
    main()
