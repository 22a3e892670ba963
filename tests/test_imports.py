"""The import graph of the package has no circle: every import counts, the ones
inside functions too (a circle hidden by a function-level import is still a circle); only
``if TYPE_CHECKING:`` blocks, which never run, are left out."""

from __future__ import annotations

import ast
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kvformat": "kvformat",
    "kvsnap": "kvsnap",
    "kvsnap.analysis": "analysis",
    "kvsnap.capture": "capture",
}


def modules() -> dict[str, Path]:
    found = {}
    for name, folder in PACKAGES.items():
        for path in (REPOSITORY / folder).rglob("*.py"):
            parts = [
                p for p in path.relative_to(REPOSITORY / folder).with_suffix("").parts if p != "__init__"
            ]
            found[".".join([name, *parts])] = path
    return found


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a package's ``__init__`` is the package)."""
    found = modules()
    edges: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in found else base for a in node.names]
            for target in targets:
                while target and target not in found:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions() -> None:
    """The check can fail: a function-level import is an edge, a TYPE_CHECKING one is not."""
    edges = graph()
    assert "kvsnap.analysis.rows" in edges["kvsnap.analysis.accumulator"]  # imported inside a method
    assert "kvsnap.analysis.accumulator" not in edges["kvsnap.analysis.rows"]  # TYPE_CHECKING only
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_anywhere_in_the_package() -> None:
    assert circles(graph()) == []
