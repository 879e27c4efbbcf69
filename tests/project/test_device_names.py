"""Only the device layer, the package grpo_ascend/device/, may name a device type or collective backend.

Code is checked, prose is not: identifiers, attribute names, imports and string literals
(f-strings included) are matched; comments and docstrings may mention Ascend NPUs or CUDA.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from fake_device import autoloaded_broken_torch_npu

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("grpo_ascend", "reward_models")
DEVICE_LAYER = Path("grpo_ascend/device")
DEVICE_NAME = re.compile(r"(?i)\b(torch_npu|npu|cuda|hccl|nccl)\b")


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    found.add(id(body[0].value))
    return found


def _names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) for every identifier, attribute, import and non-docstring string in ``tree``."""
    docstrings = _docstring_nodes(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            yield line, node.id
        elif isinstance(node, ast.Attribute):
            yield line, node.attr
        elif isinstance(node, ast.alias):
            yield line, node.name
            if node.asname:
                yield line, node.asname
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield line, node.module
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield line, node.name
        elif isinstance(node, ast.arg):
            yield line, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield line, node.arg
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield line, node.value


def offending_lines(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """Sorted (line, matched word) pairs where ``source`` names a device type or backend."""
    tree = ast.parse(source, filename=filename)
    hits = {(line, match.group(0)) for line, text in _names(tree) for match in DEVICE_NAME.finditer(text)}
    return sorted(hits)


def test_checker_flags_code_and_skips_prose():
    source = '''"""Runs fast on NPU and CUDA."""
import torch_npu  # comment: npu
x = torch.cuda.is_available()
backend = "hccl"
def f(device):
    """Moves to the NPU."""
    return f"{device}:nccl"
npu_patches = apply_npu_patches(model)
'''
    assert offending_lines(source) == [(2, "torch_npu"), (3, "cuda"), (4, "hccl"), (7, "nccl")]


def test_only_the_device_layer_names_devices():
    problems = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO)
            if DEVICE_LAYER in relative.parents:
                continue
            source = path.read_text(encoding="utf-8")
            problems += [f"{relative}:{line}: {word}" for line, word in offending_lines(source, str(relative))]
    assert not problems, (
        "only the device layer (grpo_ascend/device/) may name a device type or backend; "
        "call grpo_ascend.device instead:\n" + "\n".join(problems)
    )


#: Imports every module of the device layer (they import torch, never torch_npu).
_IMPORT_DEVICE_LAYER = "import " + ", ".join(
    f"grpo_ascend.device.{path.stem}" for path in sorted((REPO / DEVICE_LAYER).glob("*.py")) if path.stem != "__init__"
)


def _run(code: str, tmp_path: Path, autoload: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]), "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_package_import_does_not_import_torch_npu(tmp_path):
    # As on an NPU host where torch_npu is installed: with torch's autoload off (otherwise torch, not
    # grpo_ascend, imports it), importing every grpo_ascend module must leave torch_npu unimported.
    # trl is optional too: the trainer recognises TRL's GRPOConfig without importing trl.
    autoloaded_broken_torch_npu(tmp_path)
    code = (
        "import grpo_ascend, reward_models; import sys; assert 'torch_npu' not in sys.modules; "
        f"import grpo_ascend.cli; {_IMPORT_DEVICE_LAYER}; "
        "import grpo_ascend.trainers.grpo, grpo_ascend.config.trl_compat, grpo_ascend.checkpoints.hub; "
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported'; "
        "assert 'trl' not in sys.modules, 'trl imported (it is optional: TRL configs are recognised by class)'"
    )
    result = _run(code, tmp_path, autoload="0")
    assert result.returncode == 0, result.stderr


def test_cli_imports_without_torch(tmp_path):
    # With autoload on, a broken torch_npu makes `import torch` fail; the CLI and doctor must still import.
    autoloaded_broken_torch_npu(tmp_path)
    code = "import sys, grpo_ascend, grpo_ascend.cli, grpo_ascend.device, grpo_ascend.device.doctor; assert 'torch' not in sys.modules"
    assert _run(code, tmp_path, autoload="1").returncode == 0
    assert _run("import torch", tmp_path, autoload="1").returncode != 0  # the fake really breaks torch


# Distributed engines (DeepSpeed, FSDP2, ...) are named only by their strategy modules in
# grpo_ascend/distributed/: the trainer calls a strategy and never asks which engine runs. Unlike device
# names this covers prose too (docstrings, comments, help texts), as the pre-commit hook greps.
ENGINE_NAME = re.compile(r"deepspeed|DeepSpeed|FSDP|fully_shard|DTensor|DistributedType")
ENGINE_PACKAGE = Path("grpo_ascend/distributed")


def test_only_strategy_modules_name_distributed_engines():
    problems = []
    for path in sorted((REPO / "grpo_ascend").rglob("*.py")):
        relative = path.relative_to(REPO)
        if ENGINE_PACKAGE in relative.parents:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            problems += [f"{relative}:{number}: {m.group(0)}" for m in ENGINE_NAME.finditer(line)]
    assert not problems, (
        "only grpo_ascend/distributed/ may name a distributed engine; call the run's strategy instead:\n"
        + "\n".join(problems)
    )


def test_engine_checker_matches_what_the_hook_greps():
    assert ENGINE_NAME.search("import deepspeed") and ENGINE_NAME.search("FSDP2 shards")
    assert ENGINE_NAME.search("x: DTensor") and ENGINE_NAME.search("DistributedType.NO")
    assert not ENGINE_NAME.search("ZeRO-3 partitions parameters; fsdp_version")  # the hook is case-sensitive
