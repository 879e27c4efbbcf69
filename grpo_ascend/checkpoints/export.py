"""Export a trained policy: the LoRA adapter in PEFT's own format, or a merged full model.

The adapter export (``adapter_config.json`` + ``adapter_model.safetensors`` + tokenizer) loads with
``PeftModel.from_pretrained(base, DIR)`` and with vLLM's LoRA support; ``merge=True`` folds the
adapter into the base weights and writes a plain model that ``AutoModelForCausalLM.from_pretrained``
loads. The source is a checkpoint folder written by :mod:`grpo_ascend.checkpoints.checkpoint` (which records the
base model, so ``grpo-ascend export CHECKPOINT --out DIR`` needs nothing else) or a live model at
the end of training. The output folder is written atomically, like checkpoints.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from grpo_ascend.checkpoints import files as io
from grpo_ascend.checkpoints import run_folders
from grpo_ascend.checkpoints import weights as stored
from grpo_ascend.checkpoints.adapters import (
    adapter_config_dict,
    adapter_names,
    adapter_state_dict,
    check_tensors,
    copy_tensors_into,
    load_adapter_state_dict,
    non_adapter_trainable,
)
from grpo_ascend.checkpoints.best import best_checkpoint, resolve_best_path
from grpo_ascend.errors import CheckpointError, ConfigError, closest
from grpo_ascend.models.policy import apply_peft, load_causal_lm
from grpo_ascend.models.tiny_model import resolve_builtin
from grpo_ascend.models.vision_language import PROCESSOR_FILES, load_processor
from grpo_ascend.models.wrappers import is_peft, unwrap_model

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
# Files whose presence marks a folder as an earlier export that may be replaced.
_EXPORT_MARKERS = (stored.ADAPTER_CONFIG_NAME, "config.json")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``'bf16'``/``'fp16'``/``'fp32'`` (or the long names) to a torch dtype; None keeps the stored one."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower()
    if key not in DTYPES:
        raise ConfigError(f"unknown export dtype {dtype!r}{closest(key, DTYPES)}; expected bf16, fp16 or fp32")
    return DTYPES[key]


def _resolve_base(name: str) -> str:
    """``builtin:*`` names to their offline folder; other paths / hub ids unchanged."""

    built = resolve_builtin(name)
    return str(built) if built is not None else name


def _cast(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous()
    return out


# --------------------------------------------------------------------------------------------
# output folder
# --------------------------------------------------------------------------------------------


def _check_out_dir(out: Path, sources: list[Path]) -> None:
    """Refuse an output folder that overlaps a source, is a file, or holds something other than an export."""
    target = out.resolve()
    for source in sources:
        source = source.resolve()
        if target == source or source in target.parents or target in source.parents:
            raise ConfigError(f"--out {str(out)!r} overlaps the checkpoint {str(source)!r}; choose a folder outside it")
    if target.is_file():
        raise ConfigError(f"--out {str(out)!r} is a file; give a folder")
    if target.is_dir() and any(target.iterdir()):
        if not any((target / marker).exists() for marker in _EXPORT_MARKERS):
            raise ConfigError(
                f"--out {str(out)!r} exists and holds files that are not an earlier export; "
                f"choose an empty or new folder"
            )


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def _save_tokenizer(out: Path, tokenizer: Any, sources: list[str | Path | None]) -> None:
    """Save ``tokenizer`` (or a vision-language model's processor), else the first found among ``sources``
    (checkpoint, base model): a folder with a processor gives its processor, else its tokenizer."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        for source in sources:
            if source is None:
                continue
            if isinstance(source, Path) and not (source / "tokenizer_config.json").is_file():
                continue
            try:
                has_processor = any((Path(source) / name).is_file() for name in PROCESSOR_FILES)
                tokenizer = load_processor(source) if has_processor else AutoTokenizer.from_pretrained(str(source))
                break
            except Exception as exc:  # a missing or unreadable tokenizer only means "look elsewhere"
                logger.debug("no tokenizer at %s: %s", source, exc)
    if tokenizer is None:
        logger.warning("no tokenizer found in the checkpoint or the base model; %s has weights only", out)
        return
    tokenizer.save_pretrained(str(out))


# --------------------------------------------------------------------------------------------
# adapter
# --------------------------------------------------------------------------------------------


def _write_adapter(out: Path, config: dict[str, Any], tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                   base_model: str | None) -> None:
    config = dict(config)
    config["inference_mode"] = True
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    io.save_tensors(out / stored.ADAPTER_WEIGHTS_NAME, _cast(tensors, dtype))
    io.write_json(out / stored.ADAPTER_CONFIG_NAME, config, "the adapter config")


def _live_adapter(model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Config and weights of a live PeftModel's active adapter."""
    adapter = adapter_names(model)[0]
    return adapter_config_dict(model, adapter), adapter_state_dict(model, adapter)


# --------------------------------------------------------------------------------------------
# merge / full model
# --------------------------------------------------------------------------------------------


def _load_base(base: str) -> torch.nn.Module:
    """The base model in fp32 on the CPU (merging in fp32 keeps the folded weights exact); a vision-language
    model with its vision tower."""
    try:
        return load_causal_lm(base, dtype="float32")
    except (OSError, ValueError, ConfigError) as exc:
        raise CheckpointError(
            f"could not load the base model {base!r} to merge into ({str(exc).splitlines()[0]}); pass the "
            f"base model's path with --base-model (base_model=...)"
        ) from exc


def _stored_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the base model's config declares (what --merge writes when --dtype is not given)."""
    config = getattr(model, "config", None)
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def _save_model(model: torch.nn.Module, out: Path, dtype: torch.dtype) -> None:
    model.to(dtype)
    if getattr(model, "config", None) is not None:
        model.config.dtype = dtype
    model.save_pretrained(str(out))


def _merge(out: Path, base: str, config: dict[str, Any], tensors: Mapping[str, torch.Tensor],
           extra: Mapping[str, torch.Tensor], dtype: torch.dtype | None, source: str) -> None:
    """Load ``base``, apply the adapter (checked tensor by tensor), fold it in and save the model."""
    from peft import PeftConfig


    model = _load_base(base)
    target_dtype = dtype or _stored_dtype(model)
    values = {k: v for k, v in config.items() if k != "auto_mapping"}
    values["base_model_name_or_path"] = base
    peft_config = PeftConfig.from_peft_type(**values)
    peft_config.inference_mode = False
    try:
        peft_model = apply_peft(model, peft_config)
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(f"the adapter from {source} does not fit base model {base!r}: {exc}") from exc
    check_tensors(
        tensors, adapter_state_dict(peft_model, "default"), Path(source),
        f"Pass the base model the adapter was trained on with --base-model (tried {base!r}).",
    )
    load_adapter_state_dict(peft_model, tensors, "default")
    if extra:
        params = dict(peft_model.named_parameters())
        used = {name: params[name] for name in extra if name in params}
        check_tensors({k: extra[k] for k in used}, used, Path(source), "")
        copy_tensors_into(used, extra)
        skipped = sorted(set(extra) - set(used))
        if skipped:
            logger.info("not part of the causal LM, left out of the merged model: %s", skipped[:5])
    merged = peft_model.merge_and_unload()
    _save_model(merged, out, target_dtype)


_PPO_PREFIXES = ("policy.", "critic.")


def _full_from_checkpoint(out: Path, folder: Path, base: str, dtype: torch.dtype | None) -> None:
    """Full fine-tuning checkpoint: base model + the saved trainable parameters, strictly by name."""
    model = _load_base(base)
    target_dtype = dtype or _stored_dtype(model)
    weights_path = folder / stored.FULL_WEIGHTS_NAME
    loaded = stored.read_full_weights(folder)
    if loaded and all(name.startswith(_PPO_PREFIXES) for name in loaded):
        # PPO full fine-tuning saves the policy and the critic side by side: export the policy.
        dropped = sum(not name.startswith("policy.") for name in loaded)
        loaded = {name.removeprefix("policy."): t for name, t in loaded.items() if name.startswith("policy.")}
        logger.info("PPO checkpoint: exporting the policy, leaving out %d critic tensor(s)", dropped)
    params = dict(model.named_parameters())
    unknown = [name for name in loaded if name not in params]
    if unknown:
        raise CheckpointError(
            f"{weights_path} does not match base model {base!r}: it has {len(unknown)} tensor(s) the model "
            f"lacks (e.g. {unknown[:3]}); pass the right base model with --base-model"
        )
    used = {name: params[name] for name in loaded}
    check_tensors(loaded, used, weights_path, f"Pass the right base model with --base-model (tried {base!r}).")
    copy_tensors_into(used, loaded)
    _save_model(model, out, target_dtype)


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------


def _checkpoint_folder(path: Path) -> Path:
    """A checkpoint folder, or the latest checkpoint of a run folder that holds checkpoint-N folders."""
    if path.is_dir() and not (path / io.MANIFEST_NAME).exists():
        latest = run_folders.find_latest_checkpoint(path)
        if latest is not None:
            logger.info("%s is a run folder; exporting its latest checkpoint %s", path, latest.name)
            return latest
    return path


def export_checkpoint(
    checkpoint_or_model: str | os.PathLike | torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    merge: bool = False,
    dtype: str | None = None,
    base_model: str | None = None,
    tokenizer: Any | None = None,
) -> Path:
    """Write the adapter (PEFT format + tokenizer), or with ``merge`` a merged model, to ``out_dir``.

    ``checkpoint_or_model`` is a checkpoint folder (or a run folder: its latest checkpoint) or a live
    model. The base model is the one recorded in the checkpoint / adapter config unless
    ``base_model`` overrides it (``builtin:*`` names allowed); the adapter export does not load it.
    ``dtype`` ('bf16', 'fp16', 'fp32') casts the written weights; by default an adapter keeps its
    dtype and a merged model gets the base model's declared dtype. A full fine-tuning checkpoint or
    model always exports as a full model. Returns the output folder.
    """
    torch_dtype = parse_dtype(dtype)
    base_override = _resolve_base(base_model) if base_model else None
    out = Path(out_dir)

    if isinstance(checkpoint_or_model, torch.nn.Module):
        model = unwrap_model(checkpoint_or_model)
        _check_out_dir(out, [])
        with io.AtomicFolder(out.resolve()) as tmp:
            if is_peft(model):
                config, tensors = _live_adapter(model)
                base = base_override or config.get("base_model_name_or_path")
                if merge:
                    if not base:
                        raise ConfigError("merging a live model needs its base model: pass base_model=PATH")
                    _merge(tmp, _resolve_base(base), config, tensors, non_adapter_trainable(model), torch_dtype,
                           "the live model")
                else:
                    _write_adapter(tmp, config, tensors, torch_dtype, base)
                _save_tokenizer(tmp, tokenizer, [base])
            else:
                state = {k: v for k, v in model.state_dict().items()}
                target = torch_dtype or next((p.dtype for p in model.parameters()), torch.float32)
                model.save_pretrained(str(tmp), state_dict=_cast(state, target))
                _patch_config_dtype(tmp, target)
                _save_tokenizer(tmp, tokenizer, [getattr(model, "name_or_path", None) or None])
        logger.info("exported %s to %s", "merged model" if merge else "model", out)
        return out

    folder = _checkpoint_folder(Path(checkpoint_or_model))
    manifest = run_folders.read_manifest(folder, verify_hashes=True)
    kind = manifest.get("kind")
    _check_out_dir(out, [folder])
    with io.AtomicFolder(out.resolve()) as tmp:
        if kind == "lora":
            config, tensors = stored.read_top_adapter(folder)
            base = base_override or config.get("base_model_name_or_path") or manifest.get("base_model_name_or_path")
            extra = stored.read_extra_trainable(folder, manifest)
            if merge:
                if not base:
                    raise CheckpointError(f"{folder} does not record its base model; pass --base-model PATH")
                _merge(tmp, _resolve_base(base), config, tensors, extra, torch_dtype,
                       str(folder / stored.ADAPTER_WEIGHTS_NAME))
            else:
                _write_adapter(tmp, config, tensors, torch_dtype, base)
                if extra:
                    logger.warning(
                        "%d trainable tensor(s) outside the LoRA adapter (e.g. %s) are not part of PEFT's adapter "
                        "format and were not exported; use --merge to fold those that belong to the model",
                        len(extra), sorted(extra)[:3],
                    )
        elif kind == "full":
            base = base_override or manifest.get("base_model_name_or_path")
            if not base:
                raise CheckpointError(f"{folder} does not record its base model; pass --base-model PATH")
            if not merge:
                logger.info("%s is a full fine-tuning checkpoint: exporting the full model", folder)
            _full_from_checkpoint(tmp, folder, _resolve_base(base), torch_dtype)
        else:
            raise CheckpointError(f"{folder / io.MANIFEST_NAME} has unknown weights kind {kind!r}")
        _save_tokenizer(tmp, tokenizer, [folder, _resolve_base(base) if base else None])
    logger.info("exported %s from %s to %s", "merged model" if merge or kind == "full" else "LoRA adapter", folder, out)
    return out


def _patch_config_dtype(folder: Path, dtype: torch.dtype) -> None:
    """Record the written dtype in config.json (save_pretrained with a cast state_dict keeps the old one)."""
    path = folder / "config.json"
    if not path.is_file():
        return
    data = io.read_json(path)
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):
        if key in data or key == "dtype":
            data[key] = name
    io.write_json(path, data, "the model config")


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``grpo-ascend export``."""
    parser.add_argument("checkpoint", help="a checkpoint-N folder, a run's output_dir (its latest checkpoint, or with "
                        "--best its best), or OUTPUT_DIR/best")
    parser.add_argument("--best", action="store_true",
                        help="export the run's best checkpoint (named by OUTPUT_DIR/best.json; needs evaluation)")
    parser.add_argument("--out", required=True, help="folder to write the export into (created; an earlier export is replaced)")
    parser.add_argument("--merge", action="store_true",
                        help="fold the LoRA adapter into the base model and write a full model")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="cast the written weights (default: adapter keeps its dtype, merge uses the base's)")
    parser.add_argument("--base-model", default=None,
                        help="base model path or hub id (default: the one recorded in the checkpoint)")


def run_export(args: argparse.Namespace) -> int:
    """``grpo-ascend export CHECKPOINT --out DIR [--merge] [--dtype bf16] [--base-model PATH]``."""

    source = best_checkpoint(args.checkpoint) if args.best else resolve_best_path(args.checkpoint)
    out = export_checkpoint(source, args.out, merge=args.merge, dtype=args.dtype, base_model=args.base_model)
    if (out / stored.ADAPTER_CONFIG_NAME).exists():
        print(f"wrote LoRA adapter to {out} (load with PeftModel.from_pretrained(base_model, {str(out)!r}))")
    else:
        print(f"wrote model to {out} (load with AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0
