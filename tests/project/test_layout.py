"""The tree's shape stays what docs/layout.md says, the package's import graph stays acyclic, and no test folder
shadows a package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from import_graph import PACKAGES, cycles, edges

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "layout.md"
DOCUMENTED_ROOTS = ("grpo_ascend", "reward_models")

#: Function-local imports of package modules that stay, each for a reason the import graph cannot show.
LAZY_LOCAL_IMPORTS = {
    # doctor must run when `import torch` fails; these two import torch.
    ("grpo_ascend.device.doctor", "grpo_ascend.device.core"),
    ("grpo_ascend.device.doctor", "grpo_ascend.device.doctor_facts"),
    # the fused LoRA kernel subclasses peft's layer when imported: peft loads only when a run uses the kernel
    ("grpo_ascend.trainers.base", "grpo_ascend.models"),
    ("grpo_ascend.trainers.base", "grpo_ascend.models.lora_kernel"),
}


def documented_paths(text: str) -> list[str]:
    """Paths of the modules and packages named in the layout's tree (first code block), one per line:
    a package is ``name/`` and its entries are indented two spaces more than it."""
    block = text.split("```", 2)[1]
    stack: list[tuple[int, str]] = []
    paths = []
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)", line)
        if not match or not (match.group(2).endswith("/") or match.group(2).endswith(".py")):
            continue
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([p for _, p in stack] + [name.rstrip("/")])
        paths.append(path + ("/" if name.endswith("/") else ""))
        if name.endswith("/"):
            stack.append((indent, name.rstrip("/")))
    return paths


def tree_paths() -> set[str]:
    out = set()
    for root in DOCUMENTED_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if path.name not in ("__init__.py", "__main__.py"):
                out.add(rel.as_posix())
            for parent in rel.parents:
                if parent != Path("."):
                    out.add(parent.as_posix() + "/")
    return out


def test_layout_lists_every_module_and_nothing_else():
    listed = documented_paths(LAYOUT.read_text(encoding="utf-8"))
    in_tree = tree_paths()
    documented = {p for p in listed if p.split("/", 1)[0] in DOCUMENTED_ROOTS}
    assert len(documented) == len([p for p in listed if p in documented]), "a module is listed twice"
    missing, stale = sorted(in_tree - documented), sorted(documented - in_tree)
    assert not missing, f"docs/layout.md does not list {missing}: add a line saying what each owns"
    assert not stale, f"docs/layout.md lists {stale}, which the tree does not have"


def test_layout_parser_reads_nesting():
    text = "```\nroot/\n  a.py   what a owns\n         continued text.py\n  sub/\n    b.py\n  c.py\n```"
    assert documented_paths(text) == ["root/", "root/a.py", "root/sub/", "root/sub/b.py", "root/c.py"]


def test_import_graph_is_acyclic():
    found = cycles(edges())
    assert not found, f"import cycles (function-local imports included): {found}"


def test_no_function_local_imports_of_package_modules():
    """A function-local import of one of our own modules hides a dependency (often a cycle); the only ones
    left are listed in LAZY_LOCAL_IMPORTS with their reason. Optional third-party packages stay lazy."""
    local = sorted({(e.source, e.target) for e in edges() if e.local} - LAZY_LOCAL_IMPORTS)
    assert not local, f"function-local imports of package modules: {local}"


def test_import_graph_reader_sees_local_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    found = {(e.source, e.target, e.local) for e in edges(pkg)}
    # importing pkg.sub.b from outside pkg.sub runs pkg/sub/__init__ too
    assert found == {("pkg.a", "pkg.sub.b", False), ("pkg.a", "pkg.sub", False), ("pkg.sub.b", "pkg.a", True)}
    assert cycles(edges(pkg)) == [["pkg.a", "pkg.sub.b"]]


@pytest.mark.parametrize("limit", [560])
def test_no_module_is_much_longer_than_500_lines(limit):
    long = {p.relative_to(ROOT).as_posix(): n for package in PACKAGES for p in package.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit}
    assert not long, f"split these by concern: {long}"


def test_no_test_folder_is_named_like_a_dependency():
    """tests/ is on ``sys.path`` while the tests run, so a folder there named like a package (tests/vllm/, tests/trl/)
    is imported as that package wherever it is not installed, and ``pytest.importorskip`` then runs the tests it
    should skip. Test folders stay clear of the requirements of pyproject.toml (and of their first word)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    names = set()
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("-", "_")
        names |= {name, name.split("_")[0]}
    assert {"vllm", "trl", "deepspeed"} <= names
    folders = {p.name for p in (ROOT / "tests").rglob("*") if p.is_dir() and p.name != "__pycache__"}
    assert not folders & names, f"rename these test folders: {sorted(folders & names)}"
