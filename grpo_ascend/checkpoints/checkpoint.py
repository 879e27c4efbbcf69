"""Checkpoints that survive a crash and resume a run exactly.

A checkpoint is the folder ``output_dir/checkpoint-{step}/``. It holds only what the base model
cannot give back: the trainable weights (a LoRA adapter in PEFT's own format, or the trainable
parameters of a fully fine-tuned model), the optimizer, LR scheduler and grad scaler states, every
RNG state, the trainer state (step, data position, metrics history), the trainer config, the
tokenizer and any extra tensors the trainer needs (a sampling generator's state, pending buffers).
:class:`CheckpointContents` groups these for :func:`save_checkpoint`.

With an optimizer sharded over the ranks (ZeRO-1/2) every rank writes its own shard
(``optimizer_shards/rank{R}.pt``) into the same temporary folder — :func:`make_staging_dir` on the
main rank, :func:`write_optimizer_shard` on each rank, a barrier — before the main rank finishes
the checkpoint with ``save_checkpoint(..., staging_dir=..., optimizer_shards=N)``; each rank reads
its shard back with :func:`load_optimizer_shard`.

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
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.checkpoints import files as io
from grpo_ascend.checkpoints.files import MANIFEST_NAME
from grpo_ascend.checkpoints.weights import (  # noqa: F401  (the weight files' names, re-exported)
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


CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = io.TMP_PREFIX + CHECKPOINT_PREFIX
TRASH_PREFIX = io.TRASH_PREFIX + CHECKPOINT_PREFIX
FORMAT_NAME = "grpo-ascend-checkpoint"
FORMAT_VERSION = 1

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
RNG_NAME = "rng_state.pt"
TRAINER_STATE_NAME = "trainer_state.json"
# Not "config.json": that name belongs to transformers' model config, and a folder holding a
# trainer config under it breaks AutoTokenizer/AutoConfig.from_pretrained on the checkpoint.
TRAINER_CONFIG_NAME = "trainer_config.json"
EXTRA_TENSORS_NAME = "extra.safetensors"
OPTIMIZER_SHARDS_DIR = "optimizer_shards"

#: Test hook: seconds to sleep after part of the files are written (crash-safety tests kill the
#: process while it sleeps). A line starting with PAUSE_MARKER is printed before sleeping.
PAUSE_ENV = "GRPO_ASCEND_TEST_PAUSE_IN_SAVE"
PAUSE_MARKER = "GRPO_ASCEND_SAVE_PAUSED"

_STEP_RE = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")


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


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step in a ``checkpoint-N`` folder name, or None for any other name."""
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------------------------


def _write_manifest(folder: Path, step: int, weights: Mapping[str, Any]) -> None:
    """The checkpoint's manifest: format, step, how the weights are stored, and every file's hash."""
    header = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "created": time.time(),
        "torch": torch.__version__,
        **weights,
    }
    io.write_manifest(folder, header)


def read_manifest(path: str | os.PathLike, verify_hashes: bool = True) -> dict[str, Any]:
    """Validate a checkpoint folder against its manifest and return the manifest.

    Every listed file must exist with its recorded size (and, with ``verify_hashes``, its sha256).
    Raises CheckpointError naming the first missing, truncated or damaged file.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {str(folder)!r} does not exist or is not a folder")
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{manifest_path} is missing: {folder.name} is not a complete grpo-ascend checkpoint (the save "
            f"was interrupted, or the folder was not written by grpo-ascend); use an earlier checkpoint"
        )
    manifest = io.read_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path} is not a grpo-ascend checkpoint manifest")
    if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} has format version {manifest.get('format_version')} but this grpo-ascend reads "
            f"up to {FORMAT_VERSION}; upgrade grpo-ascend"
        )
    io.check_manifest_files(folder, manifest["files"], verify_hashes)
    return manifest


def _incomplete_reason(folder: Path) -> str | None:
    """None for a complete checkpoint (manifest valid, sizes match), else why it is not."""
    try:
        read_manifest(folder, verify_hashes=False)
    except CheckpointError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------
# finding checkpoints
# --------------------------------------------------------------------------------------------


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``checkpoint-N`` folder in ``root``, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((step, p) for p in root.iterdir() if p.is_dir() and (step := checkpoint_step(p)) is not None)


def list_checkpoints(output_dir: str | os.PathLike, complete_only: bool = True) -> list[Path]:
    """``checkpoint-N`` folders in ``output_dir``, oldest step first (only complete ones by default)."""
    return [p for _, p in _step_folders(Path(output_dir)) if not complete_only or _incomplete_reason(p) is None]


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in ``output_dir``; temp and broken folders are skipped."""
    for _, path in reversed(_step_folders(Path(output_dir))):
        reason = _incomplete_reason(path)
        if reason is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, reason)
    return None


def resolve_checkpoint(spec: str | bool | os.PathLike | None, output_dir: str | os.PathLike) -> Path | None:
    """Turn ``resume_from_checkpoint`` into a validated folder: None/False → None, 'latest'/True → newest."""
    if spec is None or spec is False or spec == "":
        return None
    if spec is True or (isinstance(spec, str) and spec.strip().lower() == "latest"):
        latest = find_latest_checkpoint(output_dir)
        if latest is None:
            raise CheckpointError(
                f"resume_from_checkpoint='latest' but {str(output_dir)!r} has no complete "
                f"{CHECKPOINT_PREFIX}N folder; start without resume_from_checkpoint or give a checkpoint path"
            )
        return latest
    path = Path(spec)
    if not path.exists() and not path.is_absolute() and (Path(output_dir) / path).exists():
        path = Path(output_dir) / path
    read_manifest(path, verify_hashes=False)
    return path


# --------------------------------------------------------------------------------------------
# optimizer shards
# --------------------------------------------------------------------------------------------


def make_staging_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Create the hidden temporary folder a checkpoint of ``step`` is written into (main rank only).

    Pass it to :func:`write_optimizer_shard` on every rank and then to ``save_checkpoint(staging_dir=...)``.
    """
    return io.make_staging_dir(Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}")


def _shard_name(rank: int) -> str:
    return f"{OPTIMIZER_SHARDS_DIR}/rank{rank}.pt"


def write_optimizer_shard(staging_dir: str | os.PathLike, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's optimizer shard (plain tensors and Python values) into a staging folder, fsynced."""
    folder = Path(staging_dir)
    if not folder.name.startswith(TMP_PREFIX) or not folder.is_dir():
        raise CheckpointError(f"{str(folder)!r} is not a checkpoint staging folder made by make_staging_dir")
    path = folder / _shard_name(rank)
    path.parent.mkdir(exist_ok=True)
    io.torch_save(state, path)
    io.fsync_file(path)
    return path


def load_optimizer_shard(path: str | os.PathLike, rank: int, world_size: int) -> dict[str, Any]:
    """Read rank ``rank``'s optimizer shard from a checkpoint written by ``world_size`` ranks.

    The checkpoint's manifest is verified first; a checkpoint written by a different number of ranks
    (or without shards) is a CheckpointError, since each shard holds one rank's slice of the state.
    """
    folder = Path(path)
    manifest = read_manifest(folder, verify_hashes=True)
    saved = manifest.get("optimizer_shards")
    if saved is None:
        raise CheckpointError(
            f"{folder} holds one whole optimizer state, not per-rank shards: it was written without a sharded "
            "optimizer (no ZeRO); resume it the way it was trained"
        )
    if int(saved) != world_size:
        raise CheckpointError(
            f"{folder} holds optimizer shards of {saved} ranks but this run has {world_size}: the sharded "
            f"optimizer state can only be resumed with {saved} processes"
        )
    state = io.torch_load(_require(folder, manifest, _shard_name(rank), f"rank {rank}'s optimizer shard"))
    if not isinstance(state, dict):
        raise CheckpointError(f"{folder / _shard_name(rank)} does not hold an optimizer state dict")
    return state


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


def _prune(root: Path, keep: int, protect: Iterable[Path]) -> None:
    """Delete the oldest complete checkpoints beyond ``keep``; never those in ``protect``."""
    protect = {Path(p) for p in protect}
    complete = list_checkpoints(root)
    excess = len(complete) - keep
    for path in complete:
        if excess <= 0:
            break
        if path in protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.info("deleted old checkpoint %s (save_total_limit=%d)", path, keep)
        excess -= 1


def _clean_leftovers(root: Path, keep: Iterable[Path]) -> None:
    """Put back checkpoints a crashed swap moved aside, then remove temp/trash folders of crashed saves.

    Only one process saves per output_dir, so every such folder not in ``keep`` is a leftover.
    """
    io.restore_interrupted_swaps(root)
    keep = set(keep)
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and path not in keep:
            shutil.rmtree(path, ignore_errors=True)


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
    ``staging_dir`` (from :func:`make_staging_dir`) is the temporary folder to finish, into which
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


def _require(folder: Path, manifest: Mapping[str, Any], name: str, what: str) -> Path:
    if name not in manifest["files"]:
        raise CheckpointError(
            f"{folder} has no {name}: it was saved without {what}, so {what} cannot be resumed from it; "
            f"resume without passing {what}, or use a checkpoint that has one"
        )
    return folder / name


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
