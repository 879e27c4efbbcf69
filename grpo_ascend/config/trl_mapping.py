"""How a TRL field is classified and its value moved onto our settings: :class:`TRLField` (mapped, ignored,
refused), its constructors, and the converters the table in :mod:`grpo_ascend.config.trl_fields` names."""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from grpo_ascend.errors import ConfigError

Kind = Literal["mapped", "ignored", "refused"]
#: (value, the TRL config) -> our settings
Converter = Callable[[Any, Any], dict[str, Any]]


@dataclass(frozen=True)
class TRLField:
    kind: Kind
    note: str = ""
    targets: tuple[str, ...] = ()
    convert: Converter | None = None
    differs: bool = False  # mapped: the note says how our meaning differs (not just a remark)

    def settings(self, name: str, value: Any, cfg: Any) -> dict[str, Any]:
        """Our settings for TRL's ``name=value`` (mapped fields only)."""
        if self.convert is not None:
            return self.convert(plain(value), cfg)
        return {self.targets[0]: plain(value)}


def plain(value: Any) -> Any:
    """transformers turns strategy strings into enums; compare and map their values."""
    return value.value if isinstance(value, enum.Enum) else value


def same(note: str = "", differs: bool = False) -> TRLField:
    return TRLField("mapped", note, differs=differs)  # targets filled in below: the same name


def to(targets: str | tuple[str, ...], note: str = "", convert: Converter | None = None,
       differs: bool = False) -> TRLField:
    return TRLField("mapped", note, (targets,) if isinstance(targets, str) else targets, convert, differs)


def ignored(why: str) -> TRLField:
    return TRLField("ignored", why)


def refused(why: str) -> TRLField:
    return TRLField("refused", why)


def _bad(name: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"trl.GRPOConfig {name}={value!r} is not supported by grpo-ascend: expected {expected}")


def _whole_steps(name: str) -> Converter:
    def convert(value: Any, cfg: Any) -> dict[str, Any]:
        if value is not None and 0 < value < 1:
            raise _bad(name, value, "a whole number of steps (a fraction of the run is not supported)")
        return {name: None if value is None else int(value)}
    return convert


_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}


def _scheduler(value: Any, cfg: Any) -> dict[str, Any]:
    if value not in _SCHEDULES:
        raise _bad("lr_scheduler_type", value, f"one of {', '.join(_SCHEDULES)}")
    out: dict[str, Any] = {"lr_scheduler_type": _SCHEDULES[value]}
    if value == "constant":  # transformers' 'constant' has no warm-up at all
        out.update(warmup_steps=0, warmup_ratio=0.0)
    return out


def _warmup(value: Any, cfg: Any) -> dict[str, Any]:
    if plain(cfg.lr_scheduler_type) == "constant":
        return {}
    if 0 < value < 1:
        return {"warmup_ratio": float(value), "warmup_steps": 0}
    return {"warmup_steps": int(value)}


def _optim(value: Any, cfg: Any) -> dict[str, Any]:
    if value not in ("adamw_torch", "adamw_torch_fused"):
        raise _bad("optim", value, "'adamw_torch' or 'adamw_torch_fused' (grpo-ascend's optimizer is torch's AdamW)")
    return {}


def _checkpointing(value: Any, cfg: Any) -> dict[str, Any]:
    return {"gradient_checkpointing": bool(plain(cfg.activation_checkpointing))}


def _eval_strategy(value: Any, cfg: Any) -> dict[str, Any]:
    if value not in ("no", "steps"):
        raise _bad("eval_strategy", value, "'no' or 'steps' (with eval_steps)")
    return {"eval_strategy": value}


def _save_strategy(value: Any, cfg: Any) -> dict[str, Any]:
    if value not in ("steps", "no"):
        raise _bad("save_strategy", value, "'steps' (with save_steps) or 'no'")
    return {"save_steps": 0} if value == "no" else {}


def _save_steps(value: Any, cfg: Any) -> dict[str, Any]:
    if plain(cfg.save_strategy) == "no":
        return {"save_steps": 0}
    return _whole_steps("save_steps")(value, cfg)


def _metric(value: Any, cfg: Any) -> dict[str, Any]:
    """'eval_X' becomes 'X' (transformers' default 'loss', set with load_best_model_at_end, is the eval loss)."""
    if isinstance(value, str) and value.startswith("eval_"):
        value = value[len("eval_"):]
    return {"metric_for_best_model": value}


def _model_init_kwargs(value: Any, cfg: Any) -> dict[str, Any]:
    kwargs = dict(value or {})
    if cfg.trust_remote_code:
        kwargs.setdefault("trust_remote_code", True)
    return {"model_init_kwargs": kwargs or None}


def _trust_remote_code(value: Any, cfg: Any) -> dict[str, Any]:
    return _model_init_kwargs(cfg.model_init_kwargs, cfg) if value else {}


def _pad_to(value: Any, cfg: Any) -> dict[str, Any]:
    return {"length_bucket": None if value in (None, "auto") else int(value)}


def _steps_per_generation(value: Any, cfg: Any) -> dict[str, Any]:
    return {"steps_per_generation": value, "generation_batch_size": None}  # TRL resolved both; one suffices


_GENERATION_KEYS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_strings"}


#: transformers' generate() keys of beam search and its switches: they shape a search, not a sample; GRPO samples
#: num_generations completions per prompt, so they are ignored with a warning (TRL passes them to generate()).
_SEARCH_ONLY_KEYS = {"num_beams", "length_penalty", "early_stopping", "num_beam_groups", "diversity_penalty",
                     "do_sample", "num_return_sequences"}


def _generation_kwargs(value: Any, cfg: Any) -> dict[str, Any]:
    value = dict(value or {})
    search = sorted(set(value) & _SEARCH_ONLY_KEYS)
    if search:
        warnings.warn(f"generation_kwargs {search} are ignored: they shape transformers' beam / greedy search, and "
                      "the rollout engine samples num_generations completions per prompt (num_generations, "
                      "temperature, top_p, top_k, min_p and repetition_penalty set the sampling)", UserWarning,
                      stacklevel=4)
        value = {k: v for k, v in value.items() if k not in _SEARCH_ONLY_KEYS}
    unknown = sorted(set(value) - _GENERATION_KEYS)
    if unknown:
        raise _bad("generation_kwargs", value, f"only the keys {', '.join(sorted(_GENERATION_KEYS))} (the built-in "
                   f"engine samples; it has no {', '.join(unknown)})")
    if "stop_strings" in value:
        value["stop_strings"] = [value["stop_strings"]] if isinstance(value["stop_strings"], str) else list(value["stop_strings"])
    return value


_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def _loss_type(value: Any, cfg: Any) -> dict[str, Any]:
    if value not in _LOSSES:
        raise _bad("loss_type", value, f"one of {', '.join(_LOSSES)}")
    return {"loss_type": value}


def _log_completions(value: Any, cfg: Any) -> dict[str, Any]:
    return {"log_completions_steps": int(cfg.logging_steps)} if value else {}


def _print_count(value: Any, cfg: Any) -> dict[str, Any]:
    return {} if value is None else {"num_completions_to_print": int(value)}


def _use_cpu(value: Any, cfg: Any) -> dict[str, Any]:
    return {"device": "cpu"} if value else {}


def _nothing(value: Any, cfg: Any) -> dict[str, Any]:
    return {}


def _with_vllm(target: str) -> Converter:
    """TRL applies its vllm_importance_sampling_* settings only with use_vllm=True; so do we."""
    def convert(value: Any, cfg: Any) -> dict[str, Any]:
        return {target: value} if getattr(cfg, "use_vllm", False) else {}
    return convert
