"""Rank processes forked from a process that has already imported what every rank imports.

A rank of a multi-process test is a fresh Python process that spends about 8 s of CPU importing
torch, transformers, peft, accelerate, datasets and grpo_ascend before its first step of work; the
suite starts over fifty of them. Started once per pytest process, :class:`RankForker` runs this
file as a server that imports those modules (and runs nothing: no thread pool, no process group),
then forks one child per requested rank. Each child is still its own OS process with its own
environment, working directory, argv and log file, joined to the other ranks over gloo as before;
only the imports are shared, copy-on-write. Launch mechanics themselves (``accelerate launch``,
``grpo-ascend train --num-processes``) are tested with real launchers elsewhere.

``GRPO_TEST_FORK_RANKS=0`` starts every rank as a fresh interpreter instead.

Protocol, one connection per rank: the client sends one JSON line ``{"argv", "env", "cwd", "log"}``;
the server answers ``<pid>\\n`` at once and ``<exit code>\\n`` when the child ends.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

#: What a rank imports; a module missing here (e.g. no DeepSpeed installed) is skipped.
PRELOAD = (
    "torch", "torch.distributed", "transformers", "peft", "accelerate", "datasets", "yaml",
    "grpo_ascend.trainers.grpo", "grpo_ascend.trainers.ppo", "grpo_ascend.distributed.launch", "grpo_ascend.distributed.plain",
    "grpo_ascend.distributed.fsdp", "reward_models",
    "deepspeed", "grpo_ascend.distributed.deepspeed",
)


# ------------------------------------------------------------------------------ the server (this file run as a script)
def _child(request: dict, inherited: list[socket.socket]) -> None:
    """In the forked child: become the requested process and run its script as ``__main__``."""
    import runpy
    import traceback

    for sock in inherited:  # the server's listener and other ranks' connections
        sock.close()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # as `python script.py` sets it
    code = 0
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the rank's failure goes to its log, as an interpreter would print it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    """Import :data:`PRELOAD`, then fork a child per request until stdin closes (the client is gone)."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not sys.stdin.readline():
            break
        if listener in readable:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:
                _child(request, [listener, conn, *waiting.values()])
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(f"{code}\n".encode())
                except OSError:
                    pass
                conn.close()


# ------------------------------------------------------------------------------ the client
class ForkedRank:
    """A rank forked by the server: ``wait``, ``poll`` and ``kill`` as on ``subprocess.Popen``."""

    def __init__(self, conn: socket.socket):
        self._conn = conn
        self._reader = conn.makefile("r")
        self.pid = int(self._reader.readline())
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            self._read_code()
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass

    def _read_code(self) -> None:
        line = self._reader.readline()
        self.returncode = int(line) if line.strip() else -9
        self._conn.close()


class RankForker:
    """The server process of this pytest process (started at first use, stopped at exit)."""

    _instance: RankForker | None = None

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rank-forker-")
        self.path = os.path.join(self._dir, "socket")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        root = str(Path(__file__).resolve().parents[2])  # the repository root
        env["PYTHONPATH"] = os.pathsep.join([root, str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")])
        self._proc = subprocess.Popen([sys.executable, __file__, self.path], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, cwd=root, text=True)
        for line in self._proc.stdout:  # imports may print first (DeepSpeed's accelerator line)
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"the rank forker did not start (exit {self._proc.wait()})")
        atexit.register(self.close)

    @classmethod
    def shared(cls) -> RankForker | None:
        """This process's forker, or None when ``GRPO_TEST_FORK_RANKS=0``."""
        if os.environ.get("GRPO_TEST_FORK_RANKS", "1") == "0":
            return None
        if cls._instance is None or cls._instance._proc.poll() is not None:
            try:
                cls._instance = cls()
            except (OSError, RuntimeError) as error:  # no Unix sockets or fork here: fresh interpreters
                warnings.warn(f"rank forker unavailable ({error}); starting ranks as fresh interpreters", stacklevel=2)
                os.environ["GRPO_TEST_FORK_RANKS"] = "0"
                return None
        return cls._instance

    def start(self, argv: list[str], env: dict[str, str], cwd: str, log: str) -> ForkedRank:
        """Fork a rank running ``argv`` (a script and its arguments) in ``env`` and ``cwd``, output to ``log``."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall((json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}) + "\n").encode())
        return ForkedRank(conn)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            deadline = time.monotonic() + 5
            while self._proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._proc.poll() is None:
                self._proc.kill()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1])
