"""The HTTP routes a client drives a collective weight sync with, mounted by our entry point (serve.py) without
vLLM's dev mode.

* ``GET`` :data:`~.collective_sync.PROBE_PATH`: that this server receives over a group, its workers (the group
  has ``1 + workers`` ranks), their device type, the model's dtype (the wire dtype of floating tensors) and
  whether its output head is tied to the embeddings (vLLM's loader then skips the head: it is not sent), and the
  version of the full weights it last received (the training ranks that do not send wait for it).
* ``POST`` :data:`~.collective_sync.JOIN_PATH` ``{"init_info": {...}}``: every worker joins the trainer's group
  (answers once the group is built).
* ``POST`` :data:`~.collective_sync.RECEIVE_PATH` ``{"update_info": {...}, "version": ...}``: start a weight
  update, receive the buckets while the trainer broadcasts them, finish it, reset the prefix cache; answers with
  the workers' checksums when ``update_info.checksums`` asked for them.
* ``POST`` :data:`~.collective_sync.ADAPTER_PATH` ``{"update_info": {...}, "lora_name": ..., "config": {...}}``: the
  workers receive a LoRA adapter's buckets into memory under ``lora_name`` (the client then loads it through vLLM's
  ``/v1/load_lora_adapter`` with ``lora_path`` :func:`~.collective_sync.adapter_path`); answers with checksums as
  above.
* ``POST`` :data:`~.collective_sync.FORGET_ADAPTER_PATH` ``{"lora_name": ...}``: the workers drop that adapter.
* ``POST`` :data:`~.collective_sync.ECHO_PATH` ``{"nbytes": n}``: the workers receive one bucket of ``n`` bytes and
  the first sends it back (``grpo-ascend smoke --vllm-server``'s round trip).
* ``POST`` :data:`~.collective_sync.LEAVE_PATH`: the workers leave the group (the client closes).

Each call goes through vLLM's engine client (``init_weight_transfer_engine``, ``start_weight_update``, ...), so the
engine core runs it between two engine steps: no forward pass runs while the weights change.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse

from grpo_ascend.rollout.vllm.collective_sync import (
    ADAPTER_PATH,
    ECHO_PATH,
    ENGINE_NAME,
    FORGET_ADAPTER_PATH,
    JOIN_PATH,
    LEAVE_PATH,
    PROBE_PATH,
    RECEIVE_PATH,
)

router = APIRouter()


def _engine(request: Request) -> Any:
    return request.app.state.engine_client


@router.get(PROBE_PATH)
async def probe(raw_request: Request) -> JSONResponse:
    from vllm.platforms import current_platform

    config = _engine(raw_request).vllm_config
    return JSONResponse({"engine": ENGINE_NAME, "workers": int(config.parallel_config.world_size),
                         "device_type": str(current_platform.device_type),
                         "dtype": str(config.model_config.dtype).removeprefix("torch."),
                         "tied_head": bool(getattr(config.model_config.hf_text_config, "tie_word_embeddings", False)),
                         "version": getattr(raw_request.app.state, "grpo_weights_version", None)})


@router.post(JOIN_PATH)
async def join(raw_request: Request, init_info: dict[str, Any] = Body(embed=True)) -> JSONResponse:  # noqa: B008
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    await _engine(raw_request).init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
    return JSONResponse({"joined": True})


@router.post(RECEIVE_PATH)
async def receive(raw_request: Request, update_info: dict[str, Any] = Body(embed=True),  # noqa: B008
                  version: str | None = Body(None, embed=True)) -> JSONResponse:  # noqa: B008
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    engine = _engine(raw_request)
    await engine.start_weight_update()
    await engine.update_weights(request=WeightTransferUpdateRequest(update_info=update_info))
    await engine.finish_weight_update(version)
    await engine.reset_prefix_cache()
    raw_request.app.state.grpo_weights_version = version
    checksums = await engine.collective_rpc("grpo_received_checksums") if update_info.get("checksums") else []
    return JSONResponse({"received": True, "checksums": checksums})


@router.post(ADAPTER_PATH)
async def receive_adapter(raw_request: Request, update_info: dict[str, Any] = Body(embed=True),  # noqa: B008
                          lora_name: str = Body(embed=True), config: dict[str, Any] = Body(embed=True)  # noqa: B008
                          ) -> JSONResponse:
    checksums = await _engine(raw_request).collective_rpc(
        "grpo_receive_adapter", kwargs={"name": lora_name, "manifest": update_info["manifest"], "config": config,
                                        "checksums": bool(update_info.get("checksums"))})
    return JSONResponse({"received": True, "checksums": checksums if update_info.get("checksums") else []})


@router.post(FORGET_ADAPTER_PATH)
async def forget_adapter(raw_request: Request, lora_name: str = Body(embed=True)) -> JSONResponse:  # noqa: B008
    await _engine(raw_request).collective_rpc("grpo_forget_adapter", kwargs={"name": lora_name})
    return JSONResponse({"forgotten": True})


@router.post(ECHO_PATH)
async def echo(raw_request: Request, nbytes: int = Body(embed=True)) -> JSONResponse:  # noqa: B008
    await _engine(raw_request).collective_rpc("grpo_echo_bucket", kwargs={"nbytes": int(nbytes)})
    return JSONResponse({"echoed": int(nbytes)})


@router.post(LEAVE_PATH)
async def leave(raw_request: Request) -> JSONResponse:
    await _engine(raw_request).shutdown_weight_transfer_engine()
    return JSONResponse({"left": True})


def mount_transfer_routes() -> None:
    """Make vLLM's app builder add :data:`router` to every app it builds in this process (once)."""
    from vllm.entrypoints.launchers import app as launcher

    original = launcher.register_api_routers
    if getattr(original, "grpo_transfer_routes", False):
        return

    def register(args: Any, app: Any, *rest: Any, **kwargs: Any) -> None:
        original(args, app, *rest, **kwargs)
        app.include_router(router)

    register.grpo_transfer_routes = True  # type: ignore[attr-defined]
    launcher.register_api_routers = register
