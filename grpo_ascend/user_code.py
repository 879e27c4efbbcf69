"""Loading a user's object by spec: ``module:attribute`` or ``path/to/file.py:attribute``.

Shared by rewards (:mod:`reward_models.loading`), tools and environments, so every such spec loads the same
way with the same errors; ``kind`` names what is being loaded in those errors.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from grpo_ascend.errors import ConfigError, closest


def _load_file(path: str, kind: str = "reward") -> ModuleType:
    """Import a user's ``.py`` file as a module (cached per absolute path); ``kind`` names what is
    being loaded in error messages.

    The file's directory is added to ``sys.path`` so it can import sibling helper modules, as when
    it is run as a script.
    """
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ConfigError(f"{kind} file {path!r} not found (looked for {full})")
    digest = hashlib.sha1(full.encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", Path(full).stem)
    module_name = f"_reward_file_{stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, full)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{kind} file {path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    directory = os.path.dirname(full)
    if directory not in sys.path:
        sys.path.append(directory)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(f"could not load {kind} file {path!r}: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str, spec: str, kind: str = "reward") -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
            raise ConfigError(
                f"{kind} {spec!r}: importing module {name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        raise ConfigError(
            f"{kind} {spec!r}: cannot import module {name!r} ({exc}); install it or put it on PYTHONPATH, "
            "or name a file instead: path/to/file.py:function"
        ) from exc
    except Exception as exc:
        raise ConfigError(
            f"{kind} {spec!r}: importing module {name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _resolve_attribute(module: ModuleType, attr: str, spec: str, kind: str = "reward") -> Any:
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            candidates = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            raise ConfigError(
                f"{kind} {spec!r}: {getattr(module, '__file__', None) or module.__name__} has no {attr!r}"
                f"{closest(part, candidates)}; callables there: {', '.join(candidates) or '(none)'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{kind} {spec!r} is a {type(obj).__name__}, not a callable {kind} function")
    return obj


def load_object(spec: str, kind: str = "reward") -> Any:
    """The callable named by ``module:attribute`` or ``path/to/file.py:attribute`` (dotted attributes
    allowed, e.g. ``module:Class.method``); ``kind`` names what is loaded in error messages.

    Shared by rewards, tools and environments so every ``module:function`` spec loads the same way.
    """
    target, sep, attr = spec.strip().rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"{kind} {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    module = _load_file(target, kind) if target.endswith(".py") else _import_module(target, spec, kind)
    return _resolve_attribute(module, attr, spec, kind)
