"""The sandboxed ``python`` tool leaves nothing behind and cannot take the machine down: each test
checks what is left on the machine after a hostile call (files, disk, memory, processes), not only
the status. Sizes are small (a 4 MiB scratch space, a 128 MiB memory cap) so that no test can strain
a shared machine even where a mechanism does not hold."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from grpo_ascend.tools import SandboxLimits, run_python
from grpo_ascend.tools import sandbox as sandbox_module
from grpo_ascend.tools.sandbox_cgroup import create_call_group

AS_ROOT = os.geteuid() == 0
SCRATCH = 4 << 20
MEMORY = 128 << 20
LIMITS = SandboxLimits(
    timeout=2.0,
    cpu_seconds=5,
    memory_bytes=MEMORY,
    max_processes=8,
    scratch_bytes=SCRATCH,
    file_size_bytes=1 << 20,
    max_output_bytes=4000,
)
PLACES = ("/tmp", "/var/tmp", "/dev/shm")


@pytest.fixture
def name() -> str:
    """A file-name prefix no other test or run uses; whatever carries it is removed afterwards."""
    prefix = f"grpo-test-{uuid.uuid4().hex[:12]}"
    yield prefix
    for place in PLACES:
        for path in glob.glob(os.path.join(place, prefix + "*")):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def _needs_scratch(result) -> None:
    """Skip where neither a private tmpfs nor the sweep held: an unprivileged trainer on a kernel
    without user namespaces shares /tmp with the call and cannot tell its files from the call's."""
    assert result.isolation["scratch"] in {"tmpfs", "sweep", "shared"}, result.isolation
    if result.isolation["scratch"] == "shared":
        pytest.skip(f"needs root or unprivileged user namespaces: {result.isolation['scratch_note']}")


def _needs_cgroup(result) -> None:
    assert result.isolation["memory"] in {"cgroup2", "cgroup1", "rlimit"}, result.isolation
    if result.isolation["memory"] == "rlimit":
        pytest.skip(
            f"needs a cgroup for the call (root on cgroup v1 or v2): {result.isolation['memory_note']}"
        )


def _alive(pids: list[int], wait: float = 1.0) -> list[int]:
    """The pids still running after up to ``wait`` seconds (a killed process on a busy machine may
    take a moment to be scheduled and exit; zombies of a container init that does not reap count
    as gone)."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def _oom_score_adj() -> int:
    with open("/proc/self/oom_score_adj") as f:
        return int(f.read())


def test_files_written_in_tmp_var_tmp_and_dev_shm_are_gone_after_the_call(name):
    trainer_file = f"/tmp/{name}-trainer"
    with open(trainer_file, "w") as f:
        f.write("checkpoint")
    code = (
        "import os\n"
        f"for place in {PLACES!r}:\n"
        f"    with open(os.path.join(place, {name!r}), 'wb') as f:\n"
        "        f.write(b'x' * (1 << 20))\n"
        f"print(os.path.exists({trainer_file!r}), 'written')\n"
    )
    result = run_python(code, LIMITS)
    assert result.status == "ok", result.message()
    _needs_scratch(result)
    seen, written = result.stdout.split()
    assert written == "written"
    assert [p for p in PLACES if os.path.exists(os.path.join(p, name))] == []
    # The trainer's own file is untouched, and behind a private tmpfs the call did not even see it.
    assert open(trainer_file).read() == "checkpoint"
    assert seen == ("False" if result.isolation["scratch"] == "tmpfs" else "True")


def test_disk_fill_loop_stops_at_the_scratch_cap_and_leaves_nothing(name):
    chunk = 256 << 10
    code = (
        "n = 0\n"
        "try:\n"
        "    while n < 64:\n"  # 16 MiB at most, so that a shared /tmp is not filled either
        f"        with open(f'/tmp/{name}-{{n}}', 'wb') as f:\n"
        f"            f.write(b'x' * {chunk})\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print(exc.strerror)\n"
        "print(n)\n"
    )
    result = run_python(code, LIMITS)
    assert result.status == "ok", result.message()
    _needs_scratch(result)
    written = int(result.stdout.split("\n")[-2])
    if result.isolation["scratch"] == "tmpfs":
        assert "No space left on device" in result.stdout
        assert written * chunk <= SCRATCH  # the disk never held more than the cap
    else:
        assert written == 64
    assert glob.glob(f"/tmp/{name}*") == []


def test_forked_children_share_one_memory_cap():
    """Four children touch 48 MiB each (192 MiB) under a 128 MiB cap for the whole call: the OOM
    killer ends some of them, and the call never held more than the cap."""
    code = (
        "import os, time\n"
        "pids = []\n"
        "for i in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = bytearray(48 << 20)\n"
        "        for j in range(0, len(block), 4096):\n"
        "            block[j] = 1\n"
        "        time.sleep(1)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print(*pids)\n"
        "print(*[os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])\n"
    )
    result = run_python(code, LIMITS)
    assert result.status == "ok", result.message()
    _needs_cgroup(result)
    pids, codes = (line.split() for line in result.stdout.splitlines())
    assert codes.count(str(-signal.SIGKILL)) >= 1 and set(codes) <= {"0", str(-signal.SIGKILL)}
    assert result.isolation["oom_kills"] == codes.count(str(-signal.SIGKILL))
    assert result.isolation["memory_peak_bytes"] <= MEMORY
    assert _alive([int(p) for p in pids]) == []


def test_without_a_cgroup_processes_times_memory_stays_under_available_memory(monkeypatch):
    """The per-process fallback lowers ``max_processes`` so that as many processes of
    ``memory_bytes`` each fit in the memory the machine has available."""
    monkeypatch.setattr(sandbox_module, "create_call_group", lambda *_: (None, "disabled by the test"))
    huge = 1 << 40  # 1 TiB of address space per process: more than this machine has
    code = "import os\ntry:\n    os.fork() or print('forked')\nexcept OSError:\n    print('fork refused')"
    result = run_python(code, SandboxLimits(timeout=5.0, memory_bytes=huge, max_processes=32))
    assert result.isolation["memory"] == "rlimit"
    assert "disabled by the test" in result.isolation["memory_note"]
    assert result.isolation["max_processes"] == 1
    if AS_ROOT or result.isolation.get("user_namespace"):
        # RLIMIT_NPROC counts the call's own processes (its uid's, or in its user namespace);
        # otherwise it counts all of the trainer user's, which other processes may change meanwhile.
        assert result.stdout.strip() == "fork refused"


def test_sandboxed_processes_are_the_oom_killers_first_choice():
    trainer_before = _oom_score_adj()
    code = (
        "import os\n"
        "read = lambda: open('/proc/self/oom_score_adj').read().strip()\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.write(w, read().encode())\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print(read(), os.read(r, 16).decode())\n"
    )
    result = run_python(code, LIMITS)
    assert result.stdout.split() == ["1000", "1000"]
    assert result.isolation["oom_score_adj"] == 1000
    assert _oom_score_adj() == trainer_before  # the trainer keeps its own


ESCAPEES = """
import os, signal, sys, time
for i in range(2):
    if os.fork() == 0:
        os.setsid()
        print(os.getpid(), flush=True)
        if os.fork() == 0:
            print(os.getpid(), flush=True)
            while True:
                pass
        time.sleep(100)
time.sleep(0.3)
"""


@pytest.mark.parametrize(
    "ending",
    [
        "time.sleep(100)",
        "os.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(100)",
        "os.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(100)",
    ],
    ids=["sleeps", "kills-its-supervisor", "stops-its-supervisor"],
)
def test_call_never_outlives_its_timeout_by_more_than_a_second(ending):
    """Processes that left the program's session, busy or asleep, end with the call, even when the
    program kills or stops the supervisor that should end them."""
    limits = SandboxLimits(timeout=1.0, memory_bytes=MEMORY, max_processes=8, scratch_bytes=SCRATCH)
    run_python("pass", limits)  # the first call of a process checks the interpreter once
    start = time.monotonic()
    result = run_python(ESCAPEES + ending, limits)
    elapsed = time.monotonic() - start
    assert elapsed < limits.timeout + 1.0, f"took {elapsed:.2f} s"
    assert result.status in {"timeout", "supervisor_killed"}
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 4
    if not AS_ROOT and result.isolation["scratch"] != "tmpfs" and "supervisor" in ending:
        pytest.skip(
            "an unprivileged trainer without user namespaces cannot find processes its supervisor lost"
        )
    assert _alive(pids) == []


def test_trainer_survives_a_call_that_exhausts_its_memory():
    """A call that grabs memory in every process it may start ends within its limits; the trainer
    (this process) keeps running and the next call works."""
    code = (
        "import os\n"
        "for i in range(6):\n"
        "    if os.fork() == 0:\n"
        "        break\n"
        "hoard = []\n"
        "try:\n"
        "    while True:\n"
        "        hoard.append(bytearray(8 << 20))\n"
        "        hoard[-1][::4096] = b'x' * len(range(0, 8 << 20, 4096))\n"
        "except MemoryError:\n"
        "    pass\n"
        "import time\n"
        "time.sleep(100)\n"
    )
    start = time.monotonic()
    result = run_python(code, LIMITS)
    assert time.monotonic() - start < LIMITS.timeout + 1.0
    assert result.status in {"timeout", "killed"}
    os.kill(os.getpid(), 0)
    if result.isolation["memory"] != "rlimit":
        assert result.isolation["memory_peak_bytes"] <= MEMORY and result.isolation["oom_kills"] >= 1
        if result.status == "killed":  # the OOM killer took the program itself
            assert result.message() == (
                f"Error: the program ran out of memory ({MEMORY} bytes for the whole run) and was killed."
            )
    after = run_python("print(6 * 7)", LIMITS)
    assert after.message() == "42"


@pytest.mark.skipif(
    not AS_ROOT, reason="the sweep removes files by the sandbox uid, which exists only as root"
)
def test_without_a_private_tmpfs_the_sandbox_uid_files_are_swept(name):
    """An interpreter under /tmp rules out the private tmpfs (it would hide it): the call then
    shares /tmp, and everything its uid made in world-writable places is removed afterwards,
    while other users' files there stay."""
    interpreter_dir = f"/tmp/{name}-python"
    os.mkdir(interpreter_dir, 0o755)
    interpreter = os.path.join(interpreter_dir, "python3")
    shutil.copy2(
        os.path.realpath("/usr/bin/python3") if os.path.exists("/usr/bin/python3") else sys.executable,
        interpreter,
    )
    shared = f"/tmp/{name}-shared"
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    with open(os.path.join(shared, "root.txt"), "w") as f:
        f.write("root's")
    code = (
        "import os\n"
        f"os.makedirs('/tmp/{name}-dir/sub')\n"
        f"open('/tmp/{name}-dir/sub/f', 'w').write('x')\n"
        f"open('{shared}/mine.txt', 'w').write('x')\n"
        f"open('/dev/shm/{name}', 'w').write('x')\n"
        f"open('/var/tmp/{name}', 'w').write('x')\n"
        "print('written')\n"
    )
    result = run_python(code, SandboxLimits(timeout=10.0, interpreter=interpreter))
    if not isinstance(result.isolation.get("uid"), int):
        pytest.skip(f"the copied interpreter does not run as the sandbox uid: {result.message()}")
    assert result.stdout.strip() == "written", result.message()
    assert result.isolation["scratch"] == "sweep"
    assert "lives under /tmp" in result.isolation["scratch_note"]
    assert result.isolation["swept"] == 4
    assert not os.path.exists(f"/tmp/{name}-dir") and not os.path.exists(f"{shared}/mine.txt")
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/var/tmp/{name}")
    assert open(os.path.join(shared, "root.txt")).read() == "root's"


NEXT_TRAINER = """import json
from grpo_ascend.tools.sandbox_cgroup import create_call_group
group, why = create_call_group(16 << 20, 4)
print(json.dumps(why if group is None else {"dirs": [str(d) for d in group.dirs], "removed": group.remove()}))
"""


def test_cgroups_of_trainers_that_died_mid_call_are_removed():
    """A trainer killed during a call cannot remove its call's (by then empty) cgroup: the next
    trainer process removes it when it makes its first group there."""
    group, why = create_call_group(16 << 20, 4)
    if group is None:
        pytest.skip(f"needs a cgroup for the call (root on cgroup v1 or v2): {why}")
    dead = next(pid for pid in range(999_999, 0, -1) if not os.path.exists(f"/proc/{pid}"))
    stale = [d.parent / f"grpo-sandbox-{dead}-0" for d in group.dirs]
    for path in stale:
        path.mkdir()
    assert group.remove()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", NEXT_TRAINER], capture_output=True, text=True, env=env,
                          cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    fresh = json.loads(done.stdout.splitlines()[-1])
    assert isinstance(fresh, dict) and fresh["removed"], fresh
    assert [p for p in stale if p.exists()] == []
    assert [d for d in (*group.dirs, *map(Path, fresh["dirs"])) if d.exists()] == []
