"""Tests and benchmarks reach the package through its public names only, so that renaming a private one
(a leading underscore) breaks no test that should not care.

The scan reads tests/ and bench/ (AST) for imports of underscore names from ``grpo_ascend`` / ``reward_models``,
attribute reads and writes of underscore names the package defines (``trainer._save``, ``module._CACHE``),
such names as strings (``monkeypatch.setattr(module, "_CACHE", ...)``, dotted paths) and methods of
subclasses of package classes that override them. The tests also keep to bench's public names. A file's
own underscore names (its helpers, its classes' attributes) are its business. Dunder names are public.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("grpo_ascend", "reward_models")
SCANNED = ("tests", "bench")
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()  # names privates only as samples of the scan

#: (file, name) -> why the file must name that private; keep it empty unless there is truly no public way.
ALLOWED: dict[tuple[str, str], str] = {}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and len(name) > 1


def _class_names(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body defines: functions, classes, assignment targets (nested classes too)."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            out.add(node.name)
            out |= _class_names(node.body)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def defined_names(tree: ast.Module) -> set[str]:
    """The underscore names a module defines at module or class level, and its ``self.x`` / ``cls.x`` attributes."""
    names = _class_names(tree.body)
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for sub in ast.walk(target):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id in ("self", "cls")):
                    names.add(sub.attr)
    return {n for n in names if is_private(n)}


def package_privates(roots: tuple[Path, ...]) -> set[str]:
    """Every underscore name the modules under ``roots`` define (see :func:`defined_names`)."""
    return set().union(*(defined_names(ast.parse(p.read_text(encoding="utf-8")))
                         for root in roots for p in root.rglob("*.py")))


def _owned_module(name: str, owners: tuple[str, ...]) -> bool:
    return name.split(".")[0] in owners


def _root_name(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def _private_part(dotted: str) -> str | None:
    return next((part for part in dotted.split(".") if is_private(part)), None)


def private_references(tree: ast.Module, owned: set[str], owners: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(line, the underscore name, how it is named) of each place ``tree`` names an underscore name of the
    ``owners`` modules; ``owned``: the underscore names those modules define."""
    own = defined_names(tree)
    imported = set()  # names bound to the owners' objects: their subclasses' overrides are found too
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _owned_module(node.module or "", owners):
            for alias in node.names:
                imported.add(alias.asname or alias.name)
                private = _private_part(f"{node.module}.{alias.name}")
                if private:
                    found.append((node.lineno, private, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _owned_module(alias.name, owners):
                    imported.add((alias.asname or alias.name).split(".")[0])
                    if _private_part(alias.name):
                        found.append((node.lineno, _private_part(alias.name), f"import {alias.name}"))
    overridden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
                isinstance(b, (ast.Name, ast.Attribute)) and _root_name(b) in imported for b in node.bases):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in owned:
                    found.append((item.lineno, item.name, f"{node.name}.{item.name} overrides the package's"))
                    overridden.add(item.name)
    foreign = owned - (own - overridden)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in foreign:
            found.append((node.lineno, node.attr, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text in foreign:
                found.append((node.lineno, text, repr(text)))
            elif (_owned_module(text, owners) and text.replace(".", "").isidentifier()
                  and _private_part(text)):
                found.append((node.lineno, _private_part(text), repr(text)))
    return sorted(set(found))


def scan() -> dict[str, list[tuple[int, str, str]]]:
    """file -> its references to private names of the package (tests: of bench's modules too)."""
    package = package_privates(tuple(ROOT / p for p in PACKAGES))
    bench_modules = tuple(p.stem for p in (ROOT / "bench").glob("*.py"))
    with_bench = package | package_privates((ROOT / "bench",))
    out = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == SELF:
                continue
            owners, owned = (PACKAGES + bench_modules, with_bench) if folder == "tests" else (PACKAGES, package)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            hits = [hit for hit in private_references(tree, owned, owners) if (rel, hit[1]) not in ALLOWED]
            if hits:
                out[rel] = hits
    return out


def test_tests_and_benchmarks_use_public_names_only():
    found = scan()
    listed = "\n".join(f"  {path}:{line}: {how}" for path, hits in found.items() for line, _, how in hits)
    assert not found, ("private names of the package (leading underscore) outside it; use or make a public seam, "
                       f"or observe the behaviour instead:\n{listed}")


def test_the_scan_sees_every_kind_of_reference():
    source = '''
from grpo_ascend.run import _hidden, public
import grpo_ascend.trainers.base as base
import grpo_ascend._private_module
from grpo_ascend import GRPOTrainer


class Mine(GRPOTrainer):
    def _train_round(self):
        self._mine = 1


def test(trainer, monkeypatch):
    trainer._begin(None)
    base._CACHE.clear()
    monkeypatch.setattr(base, "_CACHE", {})
    monkeypatch.setattr("grpo_ascend.run._hidden", None)
    trainer.config._attn_implementation, trainer.__class__, Mine()._mine, public._own
'''
    owned = {"_hidden", "_begin", "_CACHE", "_train_round", "_own"}
    found = private_references(ast.parse(source), owned, PACKAGES)
    assert [(name, how) for _, name, how in found] == [
        ("_hidden", "from grpo_ascend.run import _hidden"), ("_private_module", "import grpo_ascend._private_module"),
        ("_train_round", "Mine._train_round overrides the package's"), ("_begin", "._begin"), ("_CACHE", "._CACHE"),
        ("_CACHE", "'_CACHE'"), ("_hidden", "'grpo_ascend.run._hidden'"), ("_own", "._own")]
