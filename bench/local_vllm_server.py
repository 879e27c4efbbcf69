"""One vLLM CPU server from our entry point (``python -m grpo_ascend.rollout.vllm.serve``) on this machine, for the
benchmarks that sample on a server (bench_weight_transfer.py, bench_async_learning.py)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path


@contextlib.contextmanager
def local_server(model_dir: str | Path, log_path: str | Path, *, dtype: str = "float32", max_model_len: int = 1024,
                 kv_cache_bytes: int = 32 * 2**20, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 start_timeout: float = 600.0) -> Iterator[str]:
    """A server of ``model_dir`` at a free local port (dev mode on, vLLM's CPU threads unbound, ``env`` added): its
    URL once ``/health`` answers. Stopped with its whole process group (the engine core too) on leaving."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_ascend.rollout.vllm.serve", "--model", str(model_dir), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", dtype, "--enforce-eager", "--kv-cache-memory-bytes", str(kv_cache_bytes),
             "--max-model-len", str(max_model_len), "--logprobs-mode", "processed_logprobs", "--seed", "0",
             "--no-enable-chunked-prefill", *extra_args],
            env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(f"{url}/health", timeout=5)
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the vLLM server did not start; its log: {log_path}")
                time.sleep(2)
            yield url
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def _die_with_parent() -> None:
    """In the server's process before it starts: SIGTERM when the benchmark that started it dies, even killed (an
    out-of-memory kill skips the ``finally`` above and would leave a server of gigabytes running)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
