"""Checkpoints that survive a crash and resume a run exactly.

A checkpoint is the folder ``output_dir/checkpoint-{step}/``. It holds only what the base model
cannot give back: the trainable weights (a LoRA adapter in PEFT's own format, or the trainable
parameters of a fully fine-tuned model), the optimizer, LR scheduler and grad scaler states, every
RNG state, the trainer state (step, data position, metrics history), the trainer config, the
tokenizer and any extra tensors the trainer needs (a sampling generator's state, pending buffers).
:class:`CheckpointContents` groups these for :func:`save_checkpoint`.

With an optimizer sharded over the ranks (ZeRO-1/2) every rank writes its own shard
(``optimizer_shards/rank{R}.pt``) into the same temporary folder — ``make_staging_dir`` on the
main rank, ``write_optimizer_shard`` on each rank, a barrier (:mod:`grpo_ascend.checkpoints.optimizer_shards`) —
before the main rank finishes the checkpoint with ``save_checkpoint(..., staging_dir=..., optimizer_shards=N)``;
each rank reads its shard back with ``load_optimizer_shard``. Finding, listing and pruning the
``checkpoint-N`` folders and their manifest: :mod:`grpo_ascend.checkpoints.run_folders`.

Saving is atomic (:class:`~grpo_ascend.checkpoints.files.AtomicFolder`): everything is written into a
hidden temporary folder next to the final one, ``manifest.json`` (sizes and sha256 of every file)
last, every file and folder is fsynced, and only then is the folder renamed to its final name. A
crash at any moment therefore leaves every earlier checkpoint untouched, and a folder named
``checkpoint-N`` with a valid manifest is complete. Loading checks the manifest before reading
anything, reads tensors with safetensors and everything else with ``torch.load(weights_only=True)``,
and loads weights strictly: a different model or LoRA shape, a missing or truncated file is a
:class:`~grpo_ascend.errors.CheckpointError` naming the file or tensor, never a partial load.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.checkpoints import files as io
from grpo_ascend.checkpoints.files import MANIFEST_NAME  # noqa: F401  (a checkpoint's file names, re-exported)
from grpo_ascend.checkpoints.optimizer_shards import _shard_name
from grpo_ascend.checkpoints.run_folders import (  # noqa: F401  (find / resolve: documented here, docs/checkpoints.md)
    CHECKPOINT_PREFIX,
    _clean_leftovers,
    _prune,
    _require,
    _write_manifest,
    find_latest_checkpoint,
    read_manifest,
    resolve_checkpoint,
)
from grpo_ascend.checkpoints.weights import (  # noqa: F401  (a checkpoint's file names, re-exported)
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    EXTRA_TRAINABLE_NAME,
    FULL_WEIGHTS_NAME,
    prepare_weights,
    write_weights,
)
from grpo_ascend.device import rng_state, set_rng_state
from grpo_ascend.errors import CheckpointError
from grpo_ascend.models.wrappers import unwrap_model

logger = logging.getLogger(__name__)


OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
RNG_NAME = "rng_state.pt"
TRAINER_STATE_NAME = "trainer_state.json"
# Not "config.json": that name belongs to transformers' model config, and a folder holding a
# trainer config under it breaks AutoTokenizer/AutoConfig.from_pretrained on the checkpoint.
TRAINER_CONFIG_NAME = "trainer_config.json"
EXTRA_TENSORS_NAME = "extra.safetensors"

#: Test hook: seconds to sleep after part of the files are written (crash-safety tests kill the
#: process while it sleeps). A line starting with PAUSE_MARKER is printed before sleeping.
PAUSE_ENV = "GRPO_ASCEND_TEST_PAUSE_IN_SAVE"
PAUSE_MARKER = "GRPO_ASCEND_SAVE_PAUSED"

@dataclass
class CheckpointContents:
    """What one checkpoint holds; objects left None are not saved.

    ``model`` is the unwrapped policy (a PeftModel saves its adapters in PEFT's format, anything
    else its trainable parameters). ``optimizer``, ``scheduler`` and ``scaler`` are saved through
    their ``state_dict()``. ``trainer_state`` and ``config`` must be JSON-serialisable.
    ``extra_tensors``: name → tensor the trainer needs back (a sampling generator's state).
    ``rng_device``: the accelerator whose RNG is saved with the host RNGs. ``trainable_weights``
    (parameter name → whole tensor) replaces the model's trainable parameters when those are
    sharded over the ranks (gathered first); the files are the same.
    """

    model: torch.nn.Module
    trainer_state: dict[str, Any]
    optimizer: Any | None = None
    scheduler: Any | None = None
    scaler: Any | None = None
    config: dict[str, Any] | None = None
    tokenizer: Any | None = None
    extra_tensors: dict[str, torch.Tensor] | None = None
    rng_device: torch.device | str | None = None
    trainable_weights: Mapping[str, torch.Tensor] | None = None


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns besides restoring the objects passed to it.

    ``extra_tensors`` are on the CPU; move them to the device you need.
    """

    step: int
    trainer_state: dict[str, Any]
    config: dict[str, Any] | None
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    path: Path | None = None


# --------------------------------------------------------------------------------------------
# save
# --------------------------------------------------------------------------------------------


def _pause_for_tests(folder: Path) -> None:
    seconds = os.environ.get(PAUSE_ENV)
    if not seconds:
        return
    print(f"{PAUSE_MARKER} {folder}", flush=True)
    sys.stdout.flush()
    time.sleep(float(seconds))


def _check_save_arguments(step: int, contents: CheckpointContents, save_total_limit: int | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(contents, CheckpointContents):
        raise CheckpointError(
            f"save_checkpoint takes a CheckpointContents(model=..., trainer_state=..., ...), got {type(contents).__name__}"
        )
    state = contents.trainer_state
    if not isinstance(state, dict):
        raise CheckpointError(f"trainer_state must be a dict, got {type(state).__name__}")
    if "step" in state and state["step"] != step:
        raise CheckpointError(f"trainer_state['step'] is {state['step']} but step is {step}; they must agree")
    if save_total_limit is not None and save_total_limit < 1:
        raise CheckpointError(f"save_total_limit must be >= 1 or None, got {save_total_limit}")


def _write_contents(folder: Path, step: int, contents: CheckpointContents, rng: dict[str, Any],
                    optimizer_shards: int | None) -> None:
    """Every file of the checkpoint, the manifest last."""
    if optimizer_shards is not None:
        missing = [r for r in range(optimizer_shards) if not (folder / _shard_name(r)).is_file()]
        if missing:
            raise CheckpointError(f"optimizer shards of rank(s) {missing} are missing from {folder}")
    weights = write_weights(unwrap_model(contents.model), folder, contents.trainable_weights)
    if optimizer_shards is not None:
        weights = {**weights, "optimizer_shards": optimizer_shards}
    if contents.optimizer is not None:
        io.torch_save(contents.optimizer.state_dict(), folder / OPTIMIZER_NAME)
    _pause_for_tests(folder)
    if contents.scheduler is not None:
        io.torch_save(contents.scheduler.state_dict(), folder / SCHEDULER_NAME)
    if contents.scaler is not None:
        io.torch_save(contents.scaler.state_dict(), folder / SCALER_NAME)
    io.torch_save(rng, folder / RNG_NAME)
    io.write_json(folder / TRAINER_STATE_NAME, {**contents.trainer_state, "step": step}, "trainer_state")
    if contents.config is not None:
        io.write_json(folder / TRAINER_CONFIG_NAME, contents.config, "the trainer config")
    if contents.tokenizer is not None:
        contents.tokenizer.save_pretrained(str(folder))
    if contents.extra_tensors:
        io.save_tensors(folder / EXTRA_TENSORS_NAME, contents.extra_tensors)
    _write_manifest(folder, step, weights)


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    contents: CheckpointContents,
    *,
    save_total_limit: int | None = None,
    staging_dir: str | os.PathLike | None = None,
    optimizer_shards: int | None = None,
    keep: Path | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{step}/`` atomically and return its path. Call on one process only.

    RNG states are captured first, so they are exactly those at the call. An existing folder of the
    same step is replaced only after the new one is complete. With ``save_total_limit`` the oldest
    complete checkpoints beyond that number are deleted afterwards (never the one just written, nor
    ``keep``: the best checkpoint).
    ``staging_dir`` (from ``optimizer_shards.make_staging_dir``) is the temporary folder to finish, into which
    ``optimizer_shards`` ranks already wrote their optimizer shards; the manifest covers them too.
    """
    _check_save_arguments(step, contents, save_total_limit)
    rng = rng_state(contents.rng_device)
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{step}"
    if staging_dir is not None and not io.is_staging_dir_of(staging_dir, final):
        raise CheckpointError(f"staging_dir {str(staging_dir)!r} is not a staging folder make_staging_dir made in {str(root)!r}")
    with io.AtomicFolder(final, staging=staging_dir) as tmp:
        _write_contents(tmp, step, contents, rng, optimizer_shards)
    _clean_leftovers(root, keep=[final])
    if save_total_limit is not None:
        _prune(root, save_total_limit, protect=[final] + ([Path(keep)] if keep is not None else []))
    logger.info("saved checkpoint %s", final)
    return final


# --------------------------------------------------------------------------------------------
# load
# --------------------------------------------------------------------------------------------


def _check_optimizer_state(state: Any, optimizer: torch.optim.Optimizer, path: Path) -> None:
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise CheckpointError(f"{path} does not hold an optimizer state dict")
    groups = optimizer.param_groups
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(groups) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)
    ):
        raise CheckpointError(
            f"{path} does not match the optimizer: parameter groups of sizes "
            f"{[len(s['params']) for s in saved_groups]} in the checkpoint, "
            f"{[len(g['params']) for g in groups]} in the optimizer; build the optimizer over the same "
            f"trainable parameters, in the same order, as the run that saved it"
        )
    params = {}
    for group, saved in zip(groups, saved_groups):
        params.update(zip(saved["params"], group["params"]))
    for index, values in state["state"].items():
        param = params.get(index)
        if param is None:
            raise CheckpointError(f"{path} has state for parameter #{index}, which the optimizer does not have")
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"):
            value = values.get(key)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{path} does not match the optimizer: {key!r} of parameter #{index} has shape "
                    f"{list(value.shape)} but the parameter has {list(param.shape)}; the model or LoRA shape changed"
                )


def _staged_state(obj: Any, path: Path, what: str, state: Any = None) -> Callable[[], None]:
    """Read a state dict now; return a function that loads it into ``obj`` (errors name the file)."""
    if state is None:
        state = io.torch_load(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a {what} state dict (found {type(state).__name__})")

    def apply() -> None:
        try:
            obj.load_state_dict(state)
        except Exception as exc:
            raise CheckpointError(f"{path} does not fit the {what}: {type(exc).__name__}: {exc}") from exc

    return apply


def _staged_optimizer(optimizer: torch.optim.Optimizer, folder: Path, manifest: Mapping[str, Any]) -> Callable[[], None]:
    if "optimizer_shards" in manifest and OPTIMIZER_NAME not in manifest["files"]:
        raise CheckpointError(
            f"{folder} holds an optimizer sharded over {manifest['optimizer_shards']} ranks (ZeRO optimizer shards), "
            f"not one optimizer state: resume it under the same ZeRO config with "
            f"{manifest['optimizer_shards']} processes"
        )
    path = _require(folder, manifest, OPTIMIZER_NAME, "an optimizer")
    state = io.torch_load(path)
    _check_optimizer_state(state, optimizer, path)
    return _staged_state(optimizer, path, "optimizer", state)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    scaler: Any | None = None,
    rng_device: torch.device | str | None = None,
    restore_rng: bool = True,
) -> LoadedCheckpoint:
    """Restore a checkpoint into ``model`` (and the optimizer, scheduler, scaler and RNGs given).

    The manifest is verified first (sizes and sha256), then every file is read and matched against
    the objects (weights strictly: any missing, unexpected or differently shaped tensor is an
    error) before anything is changed. Build the optimizer and scheduler exactly as in the original
    run before calling this. Objects passed as None are left alone; asking for a state the
    checkpoint lacks is an error.
    """
    folder = Path(path)
    manifest = read_manifest(folder, verify_hashes=True)
    steps = [prepare_weights(unwrap_model(model), folder, manifest)]
    if optimizer is not None:
        steps.append(_staged_optimizer(optimizer, folder, manifest))
    if scheduler is not None:
        steps.append(_staged_state(scheduler, _require(folder, manifest, SCHEDULER_NAME, "an LR scheduler"), "LR scheduler"))
    if scaler is not None:
        steps.append(_staged_state(scaler, _require(folder, manifest, SCALER_NAME, "a grad scaler"), "grad scaler"))
    trainer_state = io.read_json(_require(folder, manifest, TRAINER_STATE_NAME, "a trainer state"))
    if not isinstance(trainer_state, dict):
        raise CheckpointError(f"{folder / TRAINER_STATE_NAME} does not hold a JSON object")
    config = io.read_json(folder / TRAINER_CONFIG_NAME) if TRAINER_CONFIG_NAME in manifest["files"] else None
    extra = io.load_tensors(folder / EXTRA_TENSORS_NAME) if EXTRA_TENSORS_NAME in manifest["files"] else {}
    rng = None
    if restore_rng:
        rng_path = _require(folder, manifest, RNG_NAME, "RNG states")
        rng = io.torch_load(rng_path)
        if not isinstance(rng, dict) or not {"python", "numpy", "torch"} <= set(rng):
            raise CheckpointError(f"{rng_path} does not hold the RNG states saved by grpo-ascend")
    for apply in steps:
        apply()
    if rng is not None:
        set_rng_state(rng, rng_device)
    return LoadedCheckpoint(
        step=int(trainer_state.get("step", manifest["step"])),
        trainer_state=trainer_state,
        config=config,
        extra_tensors=extra,
        path=folder,
    )
