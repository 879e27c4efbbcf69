"""Warm-started weights of the built-in tiny models, shipped with the package.

Warm-starting ``builtin:tiny-warm`` (300 supervised steps) and ``builtin:tiny-tool-warm`` (450
more on calculator transcripts) takes minutes of CPU, and its result depends on the CPU that ran it
(float reductions are ordered differently per instruction set). The seed-0 results are therefore
shipped here, one ``<build name>.safetensors`` per model, with ``manifest.json`` recording each
file's SHA-256, the fingerprint of the tokenizer it was trained with, the losses of the warm start's first steps, and where
it was built.
:func:`grpo_ascend.models.tiny_model.build_tiny_model` installs a shipped file in seconds and rebuilds only
what is not shipped (another seed, ``from_scratch=True``). ``python -m grpo_ascend.models.builtin_weights``
rebuilds the shipped files from scratch (maintainers, after a change to the warm start).
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.json"


def manifest() -> dict[str, Any]:
    """The manifest: build name → {sha256, tokenizer, built_on}; empty when none is shipped."""
    if not MANIFEST.exists():
        return {}
    return json.loads(MANIFEST.read_text())


def shipped(name: str) -> Path | None:
    """The shipped weights file of build ``name`` (e.g. ``tiny-warm-s0-v3``), or None."""
    entry = manifest().get(name)
    path = HERE / f"{name}.safetensors"
    return path if entry is not None and path.exists() else None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's vocabulary, merges and chat template: the shipped weights are only
    valid for the exact token ids they were trained with."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    model = backend["model"]
    payload = json.dumps(
        {"vocab": model["vocab"], "merges": model.get("merges"), "added": backend.get("added_tokens"),
         "template": tokenizer.chat_template},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def verify(name: str, tokenizer: Any) -> Path | None:
    """The shipped file for ``name`` if it is intact and matches ``tokenizer``, else None (the caller
    builds from scratch); a mismatch raises, since it means the package itself is broken or stale."""
    path = shipped(name)
    if path is None:
        return None
    entry = manifest()[name]
    actual = file_sha256(path)
    if actual != entry["sha256"]:
        raise RuntimeError(
            f"shipped weights {path} are corrupt (sha256 {actual[:12]}…, manifest says {entry['sha256'][:12]}…); "
            "reinstall grpo-ascend or rebuild them with `python -m grpo_ascend.models.builtin_weights`"
        )
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint != entry["tokenizer"]:
        raise RuntimeError(
            f"the tokenizer built here (fingerprint {fingerprint[:12]}…) is not the one the shipped weights "
            f"{path.name} were trained with ({entry['tokenizer'][:12]}…): the tokenizer build changed; "
            "bump tiny_model.BUILD_VERSION and rebuild them with `python -m grpo_ascend.models.builtin_weights`"
        )
    return path


def record(name: str, weights: Path, tokenizer: Any, first_losses: list[float]) -> Path:
    """Copy a freshly built ``weights`` file in as build ``name`` and record it in the manifest, with the
    losses of its warm start's first steps (a rebuild's first steps must reproduce them)."""
    import shutil

    import torch

    target = HERE / f"{name}.safetensors"
    shutil.copyfile(weights, target)
    entries = manifest()
    entries[name] = {
        "sha256": file_sha256(target),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "first_losses": first_losses,
        "built_on": f"{platform.machine()}, {_cpu_model()}, torch {torch.__version__}, "
                    f"{torch.get_num_threads()} thread(s)",
    }
    MANIFEST.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
    return target


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
