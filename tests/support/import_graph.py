"""The import graph of the ``grpo_ascend`` and ``reward_models`` packages, read from the source (every import
statement, function-local ones included), for the tests that keep it acyclic."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "grpo_ascend"
#: The packages whose imports of each other the graph holds (reward_models imports grpo_ascend and is imported by it).
PACKAGES = (PACKAGE, ROOT / "reward_models")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    local: bool  # inside a function body: runs on first call, not at import


def module_files(roots: Path | tuple[Path, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name → source file, for every module of the packages."""
    out = {}
    for root in (roots,) if isinstance(roots, Path) else roots:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(roots: Path | tuple[Path, ...] = PACKAGES) -> list[Edge]:
    """Every import of a package module by a package module (of any of ``roots``)."""
    files = module_files(roots)
    modules = set(files)
    found = []
    for source, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node, local in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is None or resolved == source:
                    continue
                found.append(Edge(source, resolved, node.lineno, local))
                # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless the importer is inside them.
                parent = resolved.rpartition(".")[0]
                while parent in modules and not (source + ".").startswith(parent + "."):
                    found.append(Edge(source, parent, node.lineno, local))
                    parent = parent.rpartition(".")[0]
    return found


def _imports(tree: ast.AST, local: bool = False):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, local
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            continue  # annotations only: never executed
        else:
            inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _imports(node, inner)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def cycles(graph_edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in graph_edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out
