"""``python -m grpo_ascend.rollout.vllm.serve --model BASE [vLLM server arguments]``: vLLM's OpenAI-compatible
server, prepared for the vision-language models this project serves (compat_vision.py) and with vLLM's
token-in/token-out endpoint ``/inference/v1/generate`` on (``--enable-scale-out``), which takes a prompt's token
ids with its pictures. Text-only runs may use vLLM's own entry point as well (docs/vllm.md#server-mode).

It also receives collective weight syncs, without vLLM's dev mode: our weight-transfer engine is registered in
vLLM's registry and passed as ``--weight-transfer-config``, the worker extension added (``--worker-extension-cls``)
and the client's routes mounted (transfer_engine.py, transfer_routes.py; docs/vllm.md#weight-transfer).

vLLM starts its engine and worker processes with ``spawn`` (always, on the CPU), and a spawned process imports
its parent's main module before anything else: importing this module prepares vLLM, so they are prepared too.
"""

from __future__ import annotations

import json
import sys

from grpo_ascend.rollout.vllm import import_vllm
from grpo_ascend.rollout.vllm.collective_sync import ENGINE_NAME
from grpo_ascend.rollout.vllm.compat_polling import prepare_vllm_polling
from grpo_ascend.rollout.vllm.compat_vision import prepare_vllm_for_vision
from grpo_ascend.rollout.vllm.transfer_engine import WORKER_EXTENSION, register_transfer_engine
from grpo_ascend.rollout.vllm.transfer_routes import mount_transfer_routes

#: The vLLM flag that turns on ``/inference/v1/generate`` (what prompts with images are sent to).
SCALE_OUT_FLAG = "--enable-scale-out"
#: The flags that make vLLM build our weight-transfer engine in its workers, with their values.
TRANSFER_FLAGS = {"--weight-transfer-config": json.dumps({"backend": ENGINE_NAME}),
                  "--worker-extension-cls": WORKER_EXTENSION}

import_vllm()
prepare_vllm_for_vision()
prepare_vllm_polling()
register_transfer_engine()
mount_transfer_routes()


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's server with ``argv`` (default: this process's arguments), ``--enable-scale-out`` and
    :data:`TRANSFER_FLAGS` added (those given are kept)."""
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    args = list(sys.argv[1:] if argv is None else argv)
    if SCALE_OUT_FLAG not in args:
        args.append(SCALE_OUT_FLAG)
    for flag, value in TRANSFER_FLAGS.items():
        if not any(a == flag or a.startswith(flag + "=") for a in args):
            args += [flag, value]
    sys.argv = [sys.argv[0], *args]
    serve()


if __name__ == "__main__":
    main()
