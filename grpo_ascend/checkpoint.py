"""Checkpoints that survive a crash and resume a run exactly.

A checkpoint is the folder ``output_dir/checkpoint-{step}/``. It holds only what the base model
cannot give back: the trainable weights (a LoRA adapter in PEFT's own format, or the trainable
parameters of a fully fine-tuned model), the optimizer, LR scheduler and grad scaler states, every
RNG state, the trainer state (step, data position, metrics history), the trainer config, the
tokenizer and any extra tensors the trainer needs (a sampling generator's state, pending buffers).

With an optimizer sharded over the ranks (ZeRO-1/2) every rank writes its own shard
(``optimizer_shards/rank{R}.pt``) into the same temporary folder — :func:`make_staging_dir` on the
main rank, :func:`write_optimizer_shard` on each rank, a barrier — before the main rank finishes
the checkpoint with ``save_checkpoint(..., staging_dir=..., optimizer_shards=N)``; each rank reads
its shard back with :func:`load_optimizer_shard`.

Saving is atomic: everything is written into a hidden temporary folder next to the final one,
each file and the folder are fsynced, ``manifest.json`` (sizes and sha256 of every file) is
written last, and only then is the folder renamed to its final name. A crash at any moment
therefore leaves every earlier checkpoint untouched, and a folder named ``checkpoint-N`` with a
valid manifest is complete. Loading checks the manifest before reading anything, reads tensors
with safetensors and everything else with ``torch.load(weights_only=True)``, and loads weights
strictly: a different model or LoRA shape, a missing or truncated file is a
:class:`~grpo_ascend.errors.CheckpointError` naming the file or tensor, never a partial load.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from grpo_ascend.device import rng_state, set_rng_state
from grpo_ascend.errors import CheckpointError

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX
TRASH_PREFIX = ".trash-" + CHECKPOINT_PREFIX
FORMAT_NAME = "grpo-ascend-checkpoint"
FORMAT_VERSION = 1

MANIFEST_NAME = "manifest.json"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
FULL_WEIGHTS_NAME = "model.safetensors"
EXTRA_TRAINABLE_NAME = "extra_trainable.safetensors"
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
_HASH_CHUNK = 8 * 1024 * 1024
# LoRA hyper-parameters that change what the weights mean without changing their shapes.
_ADAPTER_CONFIG_FIELDS = (
    "peft_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "use_dora",
    "rank_pattern",
    "alpha_pattern",
    "bias",
    "lora_bias",
)


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
# small helpers
# --------------------------------------------------------------------------------------------


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DistributedDataParallel/DataParallel and torch.compile wrappers."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but a full fine-tuning run does not need it
        return False
    return isinstance(model, PeftModel)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    """Persist a folder's entries (a rename or new file) on POSIX; other systems cannot open folders."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: Any, what: str) -> None:
    try:
        text = json.dumps(data, indent=2, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot save {what} to {path.name}: it must be JSON-serialisable (plain dicts, lists, str, "
            f"numbers, bools, None), but {exc}; convert tensors with .tolist() or .item() first"
        ) from exc
    path.write_text(text + "\n", encoding="utf-8")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is not valid JSON ({exc}); the file is damaged") from exc


def _cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies that safetensors can write (no shared storage)."""
    out = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"tensors to save must be a dict of str -> torch.Tensor, got {type(name).__name__} -> "
                f"{type(tensor).__name__} for key {name!r}"
            )
        out[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return out


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from exc
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint file {str(path)!r} is not a readable safetensors file ({exc}); it is truncated or "
            f"damaged: resume from an earlier checkpoint"
        ) from exc


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from exc
    except Exception as exc:  # unpickling errors have many types; all mean the same to the user
        raise CheckpointError(
            f"checkpoint file {str(path)!r} cannot be read with torch.load(weights_only=True) "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); it is damaged or was "
            f"not written by grpo-ascend"
        ) from exc


def _torch_save(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step in a ``checkpoint-N`` folder name, or None for any other name."""
    match = _STEP_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------
# trainable weights
# --------------------------------------------------------------------------------------------


def _peft_adapter_names(model: torch.nn.Module) -> list[str]:
    """Adapter names, the top-level one first: 'default' as in PEFT's own layout, else the active one.

    The top-level adapter is what PeftModel.from_pretrained(base, CHECKPOINT) and export use.
    """
    names = list(model.peft_config)
    active = getattr(model, "active_adapter", None)
    first = "default" if "default" in names else active
    if isinstance(first, str) and first in names:
        names.remove(first)
        names.insert(0, first)
    return names


def _adapter_state(
    model: torch.nn.Module, adapter: str, weights: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: frozen base weights (embeddings included) come from the base model.
    return get_peft_model_state_dict(model, state_dict=weights, adapter_name=adapter, save_embedding_layers=False)


def _adapter_config_dict(model: torch.nn.Module, adapter: str) -> dict[str, Any]:
    """The adapter's config as PEFT writes it: sets as lists, inference_mode on, base model recorded."""
    config = copy.deepcopy(model.peft_config[adapter])
    if not getattr(config, "base_model_name_or_path", None):
        base = model.get_base_model()
        config.base_model_name_or_path = getattr(base, "name_or_path", None) or None
    config.inference_mode = True
    out = config.to_dict()
    for key, value in list(out.items()):
        if isinstance(value, set):
            out[key] = sorted(value)
    return out


def _non_adapter_trainable(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Trainable parameters of a PeftModel that are not part of any adapter (e.g. a value head)."""
    adapters = set(model.peft_config)
    source = weights.items() if weights is not None else _trainable_parameters(model).items()
    return {name: param for name, param in source if not adapters.intersection(name.split("."))}


def _trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters by name; tied weights appear once (named_parameters removes duplicates)."""
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def _write_weights(
    model: torch.nn.Module, folder: Path, weights: Mapping[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """Write the trainable weights into ``folder``; returns the manifest's description of them.

    ``weights``: the trainable parameters by name, given when the model's own are sharded.
    """
    if _is_peft(model):
        adapters = {}
        for index, adapter in enumerate(_peft_adapter_names(model)):
            sub = "" if index == 0 else adapter
            target = folder / sub if sub else folder
            target.mkdir(parents=True, exist_ok=True)
            state = _adapter_state(model, adapter, weights)
            save_file(_cpu_tensors(state), str(target / ADAPTER_WEIGHTS_NAME), {"format": "pt"})
            _write_json(target / ADAPTER_CONFIG_NAME, _adapter_config_dict(model, adapter), "the adapter config")
            adapters[adapter] = sub
        extra = _non_adapter_trainable(model, weights)
        if extra:
            save_file(_cpu_tensors(extra), str(folder / EXTRA_TRAINABLE_NAME), {"format": "pt"})
        base = model.get_base_model()
        return {
            "kind": "lora",
            "adapters": adapters,
            "base_model_name_or_path": getattr(base, "name_or_path", None) or None,
        }
    params = dict(weights) if weights is not None else _trainable_parameters(model)
    if not params:
        raise CheckpointError(
            "the model has no trainable parameters (every requires_grad is False); nothing to checkpoint. "
            "Unfreeze the parameters you train, or wrap the model with a LoRA adapter"
        )
    save_file(_cpu_tensors(params), str(folder / FULL_WEIGHTS_NAME), {"format": "pt"})
    return {"kind": "full", "adapters": {}, "base_model_name_or_path": getattr(model, "name_or_path", None) or None}


def _check_tensors(
    loaded: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], path: Path, how_to_fix: str
) -> None:
    """Raise CheckpointError unless ``loaded`` has exactly the names and shapes of ``expected``."""
    missing = [name for name in expected if name not in loaded]
    unexpected = [name for name in loaded if name not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) the model needs are missing (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} tensor(s) the model does not have (e.g. {unexpected[:3]})")
        raise CheckpointError(f"{path} does not match the model: {'; '.join(parts)}. {how_to_fix}")
    for name, tensor in expected.items():
        got = tuple(loaded[name].shape)
        if got != tuple(tensor.shape):
            raise CheckpointError(
                f"{path} does not match the model: tensor {name!r} has shape {list(got)} in the checkpoint "
                f"but {list(tensor.shape)} in the model. {how_to_fix}"
            )


def _check_adapter_config(saved: Mapping[str, Any], model: torch.nn.Module, adapter: str, path: Path) -> None:
    """Same LoRA hyper-parameters: a different alpha with the same rank would load silently but be wrong."""
    current = _adapter_config_dict(model, adapter)
    for key in _ADAPTER_CONFIG_FIELDS:
        mine, theirs = current.get(key), saved.get(key)
        if mine != theirs and (mine or theirs):  # None, {} and False all mean "unset"
            raise CheckpointError(
                f"{path}: LoRA setting {key!r} is {theirs!r} in the checkpoint but {mine!r} in the model "
                f"being resumed; build the model with the LoRA config the checkpoint was trained with"
            )


def _copy_into(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(values[name].to(device=param.device, dtype=param.dtype))


def _prepare_weights(model: torch.nn.Module, folder: Path, manifest: Mapping[str, Any]) -> Callable[[], None]:
    """Read and check every weight file; return a function that puts them into the model.

    Nothing in the model changes until every file has been read and matched, so a mismatch never
    leaves a half-loaded model behind.
    """
    kind = manifest.get("kind")
    fix = "Resume with the same base model and LoRA settings the checkpoint was written with."
    if _is_peft(model):
        if kind != "lora":
            raise CheckpointError(
                f"{folder} holds full-model weights ({FULL_WEIGHTS_NAME}) but the model is a LoRA PeftModel; "
                f"resume with full fine-tuning (no peft_config), or pick a LoRA checkpoint"
            )
        saved_adapters: dict[str, str] = dict(manifest.get("adapters") or {})
        model_adapters = _peft_adapter_names(model)
        if sorted(saved_adapters) != sorted(model_adapters):
            raise CheckpointError(
                f"{folder} holds adapters {sorted(saved_adapters)} but the model has {sorted(model_adapters)}; "
                f"{fix}"
            )
        staged: list[tuple[str, Path, dict[str, torch.Tensor]]] = []
        for adapter in model_adapters:
            sub = saved_adapters[adapter]
            target = folder / sub if sub else folder
            _check_adapter_config(_read_json(target / ADAPTER_CONFIG_NAME), model, adapter, target / ADAPTER_CONFIG_NAME)
            weights_path = target / ADAPTER_WEIGHTS_NAME
            loaded = _load_tensors(weights_path)
            _check_tensors(loaded, _adapter_state(model, adapter), weights_path, fix)
            staged.append((adapter, weights_path, loaded))
        extra = _non_adapter_trainable(model)
        extra_path = folder / EXTRA_TRAINABLE_NAME
        extra_loaded: dict[str, torch.Tensor] = {}
        if extra or extra_path.exists():
            extra_loaded = _load_tensors(extra_path) if extra_path.exists() else {}
            _check_tensors(extra_loaded, extra, extra_path, fix + " (trainable parameters outside the adapter)")

        def apply_peft() -> None:
            from peft import set_peft_model_state_dict

            for adapter, weights_path, loaded in staged:
                result = set_peft_model_state_dict(model, loaded, adapter_name=adapter)
                unexpected = list(getattr(result, "unexpected_keys", []) or [])
                if unexpected:
                    raise CheckpointError(f"{weights_path}: PEFT could not place tensors {unexpected[:3]}; {fix}")
            _copy_into(extra, extra_loaded)

        return apply_peft
    if kind != "full":
        raise CheckpointError(
            f"{folder} holds a LoRA adapter but the model is not a PeftModel; wrap the base model with the "
            f"same LoRA config (peft.get_peft_model) before resuming, or export the adapter instead"
        )
    weights_path = folder / FULL_WEIGHTS_NAME
    params = _trainable_parameters(model)
    loaded = _load_tensors(weights_path)
    _check_tensors(loaded, params, weights_path, fix + " Frozen parameters must stay frozen between runs.")
    return lambda: _copy_into(params, loaded)


# --------------------------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------------------------


def _list_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def _write_manifest(folder: Path, step: int, weights: Mapping[str, Any]) -> None:
    files = {}
    for path in _list_files(folder):
        _fsync_file(path)
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step": step,
        "created": time.time(),
        "torch": torch.__version__,
        **weights,
        "files": files,
    }
    tmp = folder / (MANIFEST_NAME + ".partial")
    _write_json(tmp, manifest, "the manifest")
    _fsync_file(tmp)
    os.replace(tmp, folder / MANIFEST_NAME)
    for sub in sorted({p.parent for p in _list_files(folder)} | {folder}, key=lambda p: -len(p.parts)):
        _fsync_dir(sub)


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
    manifest = _read_json(manifest_path)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path} is not a grpo-ascend checkpoint manifest")
    if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} has format version {manifest.get('format_version')} but this grpo-ascend reads "
            f"up to {FORMAT_VERSION}; upgrade grpo-ascend"
        )
    for rel, info in manifest["files"].items():
        file = folder / rel
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing (listed in {MANIFEST_NAME})")
        size = file.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is truncated or altered: {size} bytes, expected {info['size']}; "
                f"use an earlier checkpoint"
            )
        if verify_hashes and _sha256(file) != info["sha256"]:
            raise CheckpointError(
                f"checkpoint file {str(file)!r} is damaged: its sha256 does not match {MANIFEST_NAME}; "
                f"use an earlier checkpoint"
            )
    return manifest


def _incomplete_reason(folder: Path) -> str | None:
    """None for a complete checkpoint (manifest valid, sizes match), else why it is not."""
    try:
        read_manifest(folder, verify_hashes=False)
    except CheckpointError as exc:
        return str(exc)
    return None


def _is_complete(folder: Path) -> bool:
    return _incomplete_reason(folder) is None


# --------------------------------------------------------------------------------------------
# finding checkpoints
# --------------------------------------------------------------------------------------------


def list_checkpoints(output_dir: str | os.PathLike, complete_only: bool = True) -> list[Path]:
    """``checkpoint-N`` folders in ``output_dir``, oldest step first (only complete ones by default)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if p.is_dir() and (step := checkpoint_step(p)) is not None]
    found.sort()
    return [p for _, p in found if not complete_only or _is_complete(p)]


def find_latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step in ``output_dir``; temp and broken folders are skipped."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    candidates = sorted(
        ((step, p) for p in root.iterdir() if p.is_dir() and (step := checkpoint_step(p)) is not None),
        reverse=True,
    )
    for _, path in candidates:
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
# save
# --------------------------------------------------------------------------------------------


def _pause_for_tests(folder: Path) -> None:
    seconds = os.environ.get(PAUSE_ENV)
    if not seconds:
        return
    print(f"{PAUSE_MARKER} {folder}", flush=True)
    sys.stdout.flush()
    time.sleep(float(seconds))


def make_staging_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Create the hidden temporary folder a checkpoint of ``step`` is written into (main rank only).

    Pass it to :func:`write_optimizer_shard` on every rank and then to ``save_checkpoint(staging_dir=...)``.
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step}-", dir=root))


def _shard_name(rank: int) -> str:
    return f"{OPTIMIZER_SHARDS_DIR}/rank{rank}.pt"


def write_optimizer_shard(staging_dir: str | os.PathLike, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's optimizer shard (plain tensors and Python values) into a staging folder, fsynced."""
    folder = Path(staging_dir)
    if not folder.name.startswith(TMP_PREFIX) or not folder.is_dir():
        raise CheckpointError(f"{str(folder)!r} is not a checkpoint staging folder made by make_staging_dir")
    path = folder / _shard_name(rank)
    path.parent.mkdir(exist_ok=True)
    _torch_save(state, path)
    _fsync_file(path)
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
    state = _torch_load(_require(folder, manifest, _shard_name(rank), f"rank {rank}'s optimizer shard"))
    if not isinstance(state, dict):
        raise CheckpointError(f"{folder / _shard_name(rank)} does not hold an optimizer state dict")
    return state


def _prune(root: Path, keep: int, protect: Path) -> None:
    """Delete the oldest complete checkpoints beyond ``keep``; never ``protect``."""
    complete = list_checkpoints(root)
    excess = len(complete) - keep
    for path in complete:
        if excess <= 0:
            break
        if path == protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.info("deleted old checkpoint %s (save_total_limit=%d)", path, keep)
        excess -= 1


def _clean_leftovers(root: Path, keep: Iterable[Path]) -> None:
    """Remove temp/trash folders left by earlier crashed saves (only one process saves per output_dir)."""
    keep = set(keep)
    for path in root.iterdir():
        if path.is_dir() and path.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and path not in keep:
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    scaler: Any | None = None,
    trainer_state: dict[str, Any],
    config: dict[str, Any] | None = None,
    tokenizer: Any | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    rng_device: torch.device | str | None = None,
    save_total_limit: int | None = None,
    staging_dir: str | os.PathLike | None = None,
    optimizer_shards: int | None = None,
    trainable_weights: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{step}/`` atomically and return its path.

    ``model`` is the unwrapped policy (a PeftModel saves its adapters in PEFT's format, anything else
    its trainable parameters); ``trainer_state`` and ``config`` must be JSON-serialisable;
    ``rng_device`` is the accelerator whose RNG is saved with the host RNGs. RNG states are captured
    first, so they are exactly those at the call. An existing folder of the same step is replaced
    only after the new one is complete. With ``save_total_limit`` the oldest complete checkpoints
    beyond that number are deleted afterwards (never the one just written). Call on one process only.
    ``staging_dir`` (from :func:`make_staging_dir`) is the temporary folder to finish, into which
    ``optimizer_shards`` ranks already wrote their optimizer shards; the manifest covers them too.
    ``trainable_weights`` (parameter name → whole tensor) replaces the model's trainable parameters when those
    are sharded (the strategy gathers them first); the files are the same.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(trainer_state, dict):
        raise CheckpointError(f"trainer_state must be a dict, got {type(trainer_state).__name__}")
    if "step" in trainer_state and trainer_state["step"] != step:
        raise CheckpointError(f"trainer_state['step'] is {trainer_state['step']} but step is {step}; they must agree")
    if save_total_limit is not None and save_total_limit < 1:
        raise CheckpointError(f"save_total_limit must be >= 1 or None, got {save_total_limit}")
    rng = rng_state(rng_device)
    model = _unwrap(model)
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{step}"
    if staging_dir is None:
        tmp = make_staging_dir(root, step)
    else:
        tmp = Path(staging_dir)
        if tmp.parent.resolve() != root.resolve() or not tmp.name.startswith(TMP_PREFIX) or not tmp.is_dir():
            raise CheckpointError(f"staging_dir {str(tmp)!r} is not a staging folder make_staging_dir made in {str(root)!r}")
    trash = None
    try:
        if optimizer_shards is not None:
            missing = [r for r in range(optimizer_shards) if not (tmp / _shard_name(r)).is_file()]
            if missing:
                raise CheckpointError(f"optimizer shards of rank(s) {missing} are missing from {tmp}")
        weights = _write_weights(model, tmp, trainable_weights)
        if optimizer_shards is not None:
            weights = {**weights, "optimizer_shards": optimizer_shards}
        if optimizer is not None:
            _torch_save(optimizer.state_dict(), tmp / OPTIMIZER_NAME)
        _pause_for_tests(tmp)
        if scheduler is not None:
            _torch_save(scheduler.state_dict(), tmp / SCHEDULER_NAME)
        if scaler is not None:
            _torch_save(scaler.state_dict(), tmp / SCALER_NAME)
        _torch_save(rng, tmp / RNG_NAME)
        _write_json(tmp / TRAINER_STATE_NAME, {**trainer_state, "step": step}, "trainer_state")
        if config is not None:
            _write_json(tmp / TRAINER_CONFIG_NAME, config, "the trainer config")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if extra_tensors:
            save_file(_cpu_tensors(extra_tensors), str(tmp / EXTRA_TENSORS_NAME), {"format": "pt"})
        _write_manifest(tmp, step, weights)
        if final.exists():
            trash = root / f"{TRASH_PREFIX}{step}-{os.getpid()}-{time.time_ns()}"
            os.replace(final, trash)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    _clean_leftovers(root, keep=[final])
    if save_total_limit is not None:
        _prune(root, save_total_limit, protect=final)
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
        state = _torch_load(path)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a {what} state dict (found {type(state).__name__})")

    def apply() -> None:
        try:
            obj.load_state_dict(state)
        except Exception as exc:
            raise CheckpointError(f"{path} does not fit the {what}: {type(exc).__name__}: {exc}") from exc

    return apply


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
    model = _unwrap(model)
    steps = [_prepare_weights(model, folder, manifest)]
    if optimizer is not None:
        if "optimizer_shards" in manifest and OPTIMIZER_NAME not in manifest["files"]:
            raise CheckpointError(
                f"{folder} holds an optimizer sharded over {manifest['optimizer_shards']} ranks (ZeRO optimizer shards), "
                f"not one optimizer state: resume it under the same ZeRO config with "
                f"{manifest['optimizer_shards']} processes"
            )
        opt_path = _require(folder, manifest, OPTIMIZER_NAME, "an optimizer")
        opt_state = _torch_load(opt_path)
        _check_optimizer_state(opt_state, optimizer, opt_path)
        steps.append(_staged_state(optimizer, opt_path, "optimizer", opt_state))
    if scheduler is not None:
        steps.append(_staged_state(scheduler, _require(folder, manifest, SCHEDULER_NAME, "an LR scheduler"), "LR scheduler"))
    if scaler is not None:
        steps.append(_staged_state(scaler, _require(folder, manifest, SCALER_NAME, "a grad scaler"), "grad scaler"))
    trainer_state = _read_json(_require(folder, manifest, TRAINER_STATE_NAME, "a trainer state"))
    if not isinstance(trainer_state, dict):
        raise CheckpointError(f"{folder / TRAINER_STATE_NAME} does not hold a JSON object")
    config = _read_json(folder / TRAINER_CONFIG_NAME) if TRAINER_CONFIG_NAME in manifest["files"] else None
    extra = _load_tensors(folder / EXTRA_TENSORS_NAME) if EXTRA_TENSORS_NAME in manifest["files"] else {}
    rng = None
    if restore_rng:
        rng_path = _require(folder, manifest, RNG_NAME, "RNG states")
        rng = _torch_load(rng_path)
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
