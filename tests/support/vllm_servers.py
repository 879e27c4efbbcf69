"""A vLLM OpenAI server on the tiny model for the server tests (tests/rollout/vllm_backend): started at a free
port of 127.0.0.1, stopped with its engine core."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: vLLM's own server entry point, and ours (vLLM's prepared for vision-language models, the generate endpoint on).
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
OUR_SERVER = "grpo_ascend.rollout.vllm.serve"


@contextlib.contextmanager
def running_server(model_dir: str, log_dir, entry: str = VLLM_SERVER, port: int | None = None,
                   dev_mode: bool = True):
    """A vLLM OpenAI server on ``model_dir`` at ``port`` (None: a free one) of 127.0.0.1 (LoRA on, vLLM's dev mode
    as ``dev_mode`` says), started by the module ``entry``: ``(process, url, model_dir)``; stopped, its engine core
    included, on leaving."""
    port = port or free_port()
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_SERVER_DEV_MODE="1" if dev_mode else "0",
               VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1")
    log = open(log_dir / "server.log", "a")
    proc = subprocess.Popen(
        [sys.executable, "-m", entry, "--model", model_dir, "--host",
         "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes",
         str(32 * 2**20), "--max-model-len", "1024", "--logprobs-mode", "processed_logprobs", "--enable-lora",
         "--max-lora-rank", "8", "--max-loras", "2", "--seed", "0", "--no-enable-chunked-prefill"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}", model_dir
    finally:
        kill_server(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_server(proc)
        kill_server(proc)  # the engine-core child, should the API process have gone first
        log.close()


def kill_server(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the server's whole process group: killing only the API process leaves vLLM's engine core running."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
