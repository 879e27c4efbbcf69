"""The sandboxed ``python`` tool: every kind of bad code ends within its limit with a clear message,
and the test process (standing in for the trainer) is unharmed."""

from __future__ import annotations

import os
import time

import pytest

from grpo_ascend.tools import ParsedTurn, SandboxLimits, ToolCall, ToolExecutor, load_toolset, run_python

AS_ROOT = os.geteuid() == 0
FAST = SandboxLimits(
    timeout=2.0, cpu_seconds=5, memory_bytes=512 << 20, max_processes=16, max_output_bytes=1000
)
#: Python start-up plus the supervisor's bookkeeping, on a loaded 2-core machine.
SLACK = 1.5


def _alive_processes_of(uid: int) -> list[int]:
    """Pids of non-zombie processes owned by ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry))
    return pids


def _run(code: str, limits: SandboxLimits = FAST):
    start = time.monotonic()
    result = run_python(code, limits)
    elapsed = time.monotonic() - start
    assert elapsed < limits.timeout + SLACK, f"took {elapsed:.2f} s"
    return result


def test_ok_program_prints_its_output():
    result = _run("print('hi', 6 * 7)")
    assert result.status == "ok" and result.exit_code == 0
    assert result.message() == "hi 42"


def test_stdin_is_given_as_a_file():
    result = run_python(
        "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", FAST, stdin="1 2 3\n4"
    )
    assert result.message() == "10"
    unread = run_python("print('x')", FAST, stdin="y" * 1_000_000)
    assert unread.message() == "x"


def test_infinite_loop_is_killed_at_the_wall_clock_timeout():
    result = _run("while True:\n    pass")
    assert result.status == "timeout"
    assert result.duration >= FAST.timeout
    assert result.message() == "Error: the program did not finish within 2 s and was killed."


def test_cpu_seconds_limit():
    result = _run("while True:\n    pass", SandboxLimits(timeout=6.0, cpu_seconds=1))
    assert result.status == "cpu_limit" and result.duration < 4
    assert "more than 1 s of CPU time" in result.message()


def test_fork_bomb_is_contained_and_leaves_no_process_behind():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = _run(code)
    assert result.status == "timeout"
    if AS_ROOT:
        assert isinstance(result.isolation["uid"], int) and result.isolation["uid"] != 0
        assert _alive_processes_of(result.isolation["uid"]) == []


def test_ten_gigabyte_allocation_fails_with_memory_error():
    result = _run("x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.status == "error" and result.exit_code == 1
    assert "MemoryError" in result.message() and "allocated" not in result.message()


def test_hundred_megabytes_of_output_is_stopped_and_truncated():
    result = _run("import sys\nsys.stdout.write('x' * (100 * 1024 * 1024))")
    assert result.status == "output_limit"
    assert result.stdout == "x" * FAST.max_output_bytes
    assert result.message().endswith(f"printed more than {FAST.output_kill_bytes} bytes and was stopped.")


def test_syntax_error_is_reported_with_the_script_name_only():
    result = _run("def f(:\n    pass")
    assert result.status == "error"
    message = result.message()
    assert 'File "main.py", line 1' in message and "SyntaxError" in message
    assert "grpo-sandbox-" not in message


def test_killing_its_parent_does_not_reach_the_trainer():
    result = _run("import os, time\nos.kill(os.getppid(), 9)\ntime.sleep(30)")
    assert result.status == "supervisor_killed"
    assert result.message() == "Error: the program killed its supervising process and was stopped."
    os.kill(os.getpid(), 0)  # still here


@pytest.mark.skipif(
    not AS_ROOT,
    reason="an unprivileged trainer's sandboxed code runs as the trainer's user, who may signal it",
)
def test_trainer_pid_is_out_of_reach():
    result = _run(f"import os\nos.kill({os.getpid()}, 9)")
    if AS_ROOT and isinstance(result.isolation.get("uid"), int):
        assert result.status == "error" and "PermissionError" in result.message()
    os.kill(os.getpid(), 0)


def test_clean_environment_and_fresh_folder_removed_afterwards(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    code = "import os, json\nprint(json.dumps([os.getcwd(), sorted(os.environ), os.listdir('.')]))"
    result = _run(code)
    import json

    cwd, env, files = json.loads(result.stdout)
    assert "SECRET_TOKEN" not in env and set(env) <= {
        "PATH",
        "HOME",
        "TMPDIR",
        "LANG",
        "PYTHONIOENCODING",
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "LC_CTYPE",
    }
    assert files == ["main.py"] and os.path.basename(cwd).startswith("grpo-sandbox-")
    assert not os.path.exists(cwd)


@pytest.mark.skipif(not AS_ROOT, reason="uid isolation applies when the trainer runs as root")
def test_files_outside_its_folder(tmp_path):
    """As an unprivileged uid the code cannot read root-only files nor write the trainer's folders
    (here under /tmp, which a private scratch tmpfs hides altogether); world-readable files
    elsewhere stay readable."""
    secret = tmp_path / "checkpoint.bin"
    secret.write_text("weights")
    secret.chmod(0o600)
    code = (
        f"for op in (lambda: open({str(secret)!r}).read(), lambda: open({str(tmp_path / 'new')!r}, 'w')):\n"
        "    try:\n        op()\n        print('allowed')\n    except PermissionError:\n        print('denied')\n"
        "    except FileNotFoundError:\n        print('hidden')\n"
        "print(len(open('/etc/passwd').read()) > 0)"
    )
    result = _run(code)
    hidden = result.isolation["scratch"] == "tmpfs"
    assert result.stdout.split() == (["hidden", "hidden", "True"] if hidden else ["denied", "denied", "True"])
    assert secret.read_text() == "weights" and not (tmp_path / "new").exists()


def test_escaped_process_group_members_are_killed():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = _run(code)
    assert result.status == "ok" and result.stdout.strip() == "parent done"
    if AS_ROOT and isinstance(result.isolation.get("uid"), int):
        assert _alive_processes_of(result.isolation["uid"]) == []


def test_network_is_unreachable_when_isolated():
    result = _run("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)\nprint('connected')")
    assert "network_isolated" in result.isolation
    if result.isolation["network_isolated"]:
        assert result.status == "error" and "connected" not in result.stdout
        assert "Network is unreachable" in result.message()


def test_python_tool_runs_concurrently_through_the_executor():
    tools = load_toolset([{"name": "python", "timeout": 2.0}])
    turns = [
        ParsedTurn("", [ToolCall("python", {"code": f"import time\ntime.sleep(0.5)\nprint({i} * 11)"})])
        for i in range(4)
    ]
    turns.append(ParsedTurn("", [ToolCall("python", {"code": "while True: pass"})]))
    with ToolExecutor(timeout=10) as executor:
        start = time.monotonic()
        results = executor.run(turns, tools)
        elapsed = time.monotonic() - start
    assert [row[0].content for row in results[:4]] == ["0", "11", "22", "33"]
    assert results[4][0].failure is None and "did not finish within 2 s" in results[4][0].content
    assert elapsed < 2.0 + SLACK + 1.0  # not 4 x 0.5 s + 2 s in sequence
