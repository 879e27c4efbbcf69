"""Resolving a reward spec (callable, registry name, ``module:function``, ``file.py:function``, model
path, or a YAML mapping of one of these with options) to a reward function."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from grpo_ascend.errors import ConfigError, closest
from grpo_ascend.user_code import load_object
from grpo_ascend.vision.shapes_task import colour_code_reward
from reward_models.math_answer import AccuracyReward
from reward_models.reward_model import RewardModelScorer
from reward_models.rules import FormatReward, LengthPenalty, OverlongPenalty

RewardFunc = Callable[..., Any]

#: Built-in rewards by name: each value is a factory called with the spec's options that returns a
#: reward function. Add your own with :func:`register_reward`.
BUILTIN_REWARDS: dict[str, Callable[..., RewardFunc]] = {
    "accuracy": AccuracyReward,
    "format": FormatReward,
    "length_penalty": LengthPenalty,
    "overlong": OverlongPenalty,
    "reward_model": RewardModelScorer,
    "colour_code": lambda: colour_code_reward,  # the coloured-shapes task (synthetic:coloured_shapes)
}

_SPEC_FORMS = (
    "a built-in name ({names}), 'module:function', 'path/to/file.py:function', "
    "a reward model directory, or a mapping {{name: ..., option: value}}"
)


def _forms() -> str:
    return _SPEC_FORMS.format(names=", ".join(sorted(BUILTIN_REWARDS)))


def register_reward(name: str) -> Callable[[RewardFunc], RewardFunc]:
    """Decorator registering a reward function under ``name`` so specs can say just ``name``.

    Options given with the name (``{name: my_reward, scale: 2}``) are bound as keyword arguments.
    The function is returned unchanged.
    """

    def decorator(fn: RewardFunc) -> RewardFunc:
        if name in BUILTIN_REWARDS:
            raise ConfigError(f"a reward named {name!r} is already registered")

        @functools.wraps(fn)
        def factory(**options: Any) -> RewardFunc:
            return _bind(fn, options)

        BUILTIN_REWARDS[name] = factory
        return fn

    return decorator


def reward_name(fn: Any) -> str:
    """The display name of a reward function: ``__name__`` (unwrapping ``functools.partial``), else
    the class name of a callable object."""
    base = fn
    while isinstance(base, functools.partial):
        base = base.func
    name = getattr(base, "__name__", None)
    if not isinstance(name, str) or not name:
        name = type(base).__name__
    return "lambda" if name == "<lambda>" else name


def _bind(fn: RewardFunc, options: Mapping[str, Any]) -> RewardFunc:
    """``fn`` with ``options`` bound as keyword arguments (``fn`` itself when there are none)."""
    if not options:
        return fn
    _check_options(reward_name(fn), fn, options)
    return functools.partial(fn, **options)


def _check_options(label: str, factory: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """ConfigError naming the valid options when ``options`` do not fit ``factory``'s signature."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not takes_any:
        unknown = [k for k in options if k not in valid]
        if unknown:
            raise ConfigError(
                f"unknown option {unknown[0]!r} for reward {label!r}{closest(unknown[0], valid)}; "
                f"valid options: {', '.join(valid) or '(none)'}"
            )


def _check_required(label: str, factory: Callable[..., Any], options: Mapping[str, Any]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    missing = [
        n
        for n, p in signature.parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and n not in options
    ]
    if missing:
        example = ", ".join(f"{m}: ..." for m in missing)
        raise ConfigError(
            f"reward {label!r} needs the option(s) {', '.join(missing)}; write it as {{name: {label}, {example}}}"
        )


def _reward_model(
    model: Any, device: Any, processing_class: Any, options: dict[str, Any], reward_processing_class: Any = None
) -> RewardModelScorer:
    options = dict(options)
    options.setdefault("device", device)
    if reward_processing_class is not None:
        if options.get("tokenizer") is not None:
            raise ConfigError(
                "reward model: a tokenizer was given twice (the spec's tokenizer option and reward_processing_classes); "
                "keep one"
            )
        options["tokenizer"] = reward_processing_class
    if isinstance(model, torch.nn.Module) and options.get("tokenizer") is None:
        path = str(getattr(model, "name_or_path", "") or "")
        if os.path.isdir(path):
            from transformers import AutoTokenizer

            options["tokenizer"] = AutoTokenizer.from_pretrained(path)
        else:
            options["tokenizer"] = processing_class
    _check_options("reward_model", RewardModelScorer, options)
    return RewardModelScorer(model, **options)


def load_reward_function(
    spec: str | Mapping[str, Any] | RewardFunc,
    *,
    device: str | torch.device | None = None,
    processing_class: Any = None,
    reward_processing_class: Any = None,
    **options: Any,
) -> RewardFunc:
    """Turn a reward spec into a reward function ``f(prompts, completions, completion_ids, **kwargs)``.

    ``spec`` is a callable (returned as is, or with ``options`` bound as keyword arguments), a
    loaded ``PreTrainedModel`` (wrapped in :class:`RewardModelScorer`), a built-in name from
    ``BUILTIN_REWARDS`` (``options`` go to its factory), ``module:function``,
    ``path/to/file.py:function``, a reward model directory or hub id (``options`` go to
    :class:`RewardModelScorer`), or a mapping ``{"name": <one of those strings>, **options}`` as
    written in YAML. ``device``, ``processing_class`` and ``reward_processing_class`` only matter
    for reward models: the device to score on (None: automatic), the tokenizer to fall back on for a
    loaded model, and the tokenizer to score with instead of the model's own (TRL's
    ``reward_processing_classes`` entry; ignored for other rewards, as in TRL).
    """
    if isinstance(spec, Mapping):
        merged = {k: v for k, v in spec.items() if k != "name"}
        if "name" not in spec:
            raise ConfigError(
                f"a reward given as a mapping needs a 'name' key ({_forms()}); got keys {sorted(spec)}"
            )
        merged.update(options)
        return load_reward_function(spec["name"], device=device, processing_class=processing_class,
                                    reward_processing_class=reward_processing_class, **merged)
    if isinstance(spec, torch.nn.Module):
        return _reward_model(spec, device, processing_class, options, reward_processing_class)
    if callable(spec):
        return _bind(spec, options)
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"a reward must be {_forms()}, or a callable; got {spec!r}")
    text = spec.strip()
    if text in BUILTIN_REWARDS:
        factory = BUILTIN_REWARDS[text]
        if factory is RewardModelScorer:
            if "model" not in options:
                raise ConfigError(
                    "reward 'reward_model' needs the option model: {name: reward_model, model: path/to/rm}"
                )
            return _reward_model(options.pop("model"), device, processing_class, options, reward_processing_class)
        _check_options(text, factory, options)
        if inspect.isclass(factory):
            _check_required(text, factory, options)
        return factory(**options)
    if ":" in text and not os.path.isdir(text):
        obj = load_object(text, "reward")
        if inspect.isclass(obj):
            # ``module:ClassName``: a reward class, instantiated with the options.
            _check_options(text, obj, options)
            _check_required(text, obj, options)
            return obj(**options)
        return _bind(obj, options)
    if text.endswith(".py"):
        raise ConfigError(f"reward {text!r}: name the function in the file, as {text}:function_name")
    if os.path.isdir(text) or (("/" in text or os.sep in text) and not os.path.exists(text)):
        return _reward_model(text, device, processing_class, options, reward_processing_class)
    raise ConfigError(f"unknown reward {text!r}{closest(text, BUILTIN_REWARDS)}; a reward is {_forms()}")
