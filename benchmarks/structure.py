"""The shape of the source tree, counted: the import graph (imports inside functions included), its
circles, function-local imports per stage, what the stages reach of ``kvformat`` beyond its public
names, backend names tested as strings outside ``analysis/kernels``, and radon's complexity grades.

    python -m benchmarks.structure [--root .] [--json]

Modules are named as they install (``capture/x.py`` is ``kvsnap.capture.x``). An import of a
module is an edge to it and to each package above it that the importing module is not inside
(importing ``a.b.c`` runs ``a.b``'s ``__init__`` first); circles are strongly connected groups of two
or more modules, not counting the edge from a package's ``__init__`` to its own submodules.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: Source folders and the package name each installs as.
STAGES = {
    "kvformat": "kvformat",
    "kvsnap": "kvsnap",
    "capture": "kvsnap.capture",
    "analysis": "kvsnap.analysis",
    "benchmarks": "benchmarks",
}
#: The layers of ``kvsnap.analysis``, lowest first: a module imports only from its own layer or
#: below. The package's front door (``kvsnap.analysis``) and ``cli.py`` stand above them all.
ANALYSIS_LAYERS: dict[str, int] = {
    "dependencies": 0,  # the heavy and optional modules, loaded on first use
    "errors": 0,
    "machine": 0,
    "stats": 1,  # what a statistic is
    "kernels": 2,  # what fills its running sums
    "engine": 3,  # how a file or a batch is processed
    "attention": 4,  # attention and head importance from saved queries
    "tools": 4,  # diff, similarity, export, tables of tokens
    "viewer": 5,
    "commands": 5,
    "cli": 6,
}
#: Backend names that, compared as strings, mean a caller decides by kernel name.
BACKEND_NAMES = ("mlx", "cpu", "numba", "native", "reference", "cuda", "metal")


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: list[tuple[str, bool]] = field(default_factory=list)  # (target, inside a function)


def module_name(root: Path, path: Path) -> str | None:
    rel = path.relative_to(root)
    top = rel.parts[0]
    if top not in STAGES:
        return None
    parts = [STAGES[top], *rel.with_suffix("").parts[1:]]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(root: Path) -> dict[str, Module]:
    found: dict[str, Module] = {}
    for top in STAGES:
        for path in sorted((root / top).rglob("*.py")):
            if "node_modules" in path.parts:
                continue
            name = module_name(root, path)
            if name is not None:
                found[name] = Module(name, path, path.name == "__init__.py")
    return found


def _walk(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(tree):
        inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield child, inner
        yield from _walk(child, inner)


def _resolve(modules: dict[str, Module], module: Module, node: ast.AST) -> list[str]:
    """The project modules an import statement loads (empty for third-party imports)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [_known(modules, name) for name in names if _known(modules, name)]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.name.split(".")
        if not module.is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        package = ".".join([*base, *([node.module] if node.module else [])])
    else:
        package = node.module or ""
    targets = []
    exported = _all_of(modules[package]) if package in modules and modules[package].is_package else set()
    for alias in node.names:
        full = f"{package}.{alias.name}"
        if full in modules and alias.name not in exported:  # (a name in __all__ is the package's)
            targets.append(full)
        elif _known(modules, package):
            targets.append(_known(modules, package))
    return [t for t in targets if t]


def _all_of(package: Module) -> set[str]:
    """The names of ``package``'s ``__all__`` literal (empty without one)."""
    for node in ast.parse(package.path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            with contextlib.suppress(ValueError):
                return set(ast.literal_eval(node.value))
    return set()


def _known(modules: dict[str, Module], name: str) -> str:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def build(root: Path) -> dict[str, Module]:
    modules = _modules(root)
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        own = _ancestors(module.name) | ({module.name} if module.is_package else set())
        for node, in_function in _walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _resolve(modules, module, node):
                    # importing a module runs its packages' __init__ first (but not this module's own)
                    for loaded in sorted({target} | _ancestors(target)):
                        if loaded != module.name and loaded not in own and loaded in modules:
                            module.imports.append((loaded, in_function))
    return modules


def _ancestors(name: str) -> set[str]:
    """The packages above module ``name`` (``a.b.c``: ``a``, ``a.b``)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module in modules.values():
        for target, _ in module.imports:
            if module.is_package and target.startswith(module.name + "."):
                continue  # a package re-exporting its own submodules
            graph[module.name].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for name in sorted(modules):
        if name not in index:
            visit(name)
    return groups


def _analysis_part(name: str) -> str | None:
    """The first name below ``kvsnap.analysis`` of module ``name`` (its folder or module), or
    None for the package itself and modules outside it."""
    parts = name.split(".")
    return parts[2] if parts[:2] == ["kvsnap", "analysis"] and len(parts) > 2 else None


def analysis_upward(modules: dict[str, Module]) -> list[tuple[str, str]]:
    """Imports in ``kvsnap.analysis`` that run up its layers (`ANALYSIS_LAYERS`), to the shell
    (``kvsnap.cli``), or from or to a folder no layer names: ``(importer, imported)``."""
    found = []
    for module in modules.values():
        part = _analysis_part(module.name)
        if part is None:
            continue
        for target, _ in module.imports:
            if target == "kvsnap.cli" or target.startswith("kvsnap.cli."):
                found.append((module.name, target))
                continue
            other = _analysis_part(target)
            if other is None or other == part:
                continue
            layers = (ANALYSIS_LAYERS.get(part), ANALYSIS_LAYERS.get(other))
            if layers[0] is None or layers[1] is None or layers[1] > layers[0]:
                found.append((module.name, target))
    return sorted(set(found))


def analysis_folder_loops(modules: dict[str, Module]) -> list[list[str]]:
    """Loops between the folders and top modules of ``kvsnap.analysis`` (every import counted)."""
    folders: dict[str, Module] = {}
    for module in modules.values():
        part = _analysis_part(module.name)
        if part is None:
            continue
        merged = folders.setdefault(part, Module(part, module.path, True))
        for target, inside in module.imports:
            other = _analysis_part(target)
            if other is not None and other != part:
                merged.imports.append((other, inside))
    return circles(folders)


def kvformat_reached(modules: dict[str, Module], public: set[str]) -> Counter[str]:
    """kvformat modules the stages import other than the package itself and its public subpackages."""
    reached: Counter[str] = Counter()
    for module in modules.values():
        if module.name.startswith("kvformat"):
            continue
        for target, _ in module.imports:
            if target.startswith("kvformat.") and not any(
                target == p or target.startswith(p + ".") for p in public
            ):
                reached[target] += 1
    return reached


def stage_imports(root: Path, modules: dict[str, Module], stage: str) -> tuple[int, int]:
    """(imports inside functions, all imports) in one stage's folder, third-party ones included."""
    local = total = 0
    for module in modules.values():
        if module.path.relative_to(root).parts[0] != stage:
            continue
        for node, in_function in _walk(ast.parse(module.path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                    continue
                total += 1
                local += in_function
    return local, total


def backend_string_tests(root: Path, modules: dict[str, Module]) -> list[str]:
    """Places outside analysis/kernels that compare a value with a backend name."""
    names = "|".join(BACKEND_NAMES)
    pattern = re.compile(r"""(==|!=|\bin\b)\s*\(?\s*["'](""" + names + r""")["']""")
    places = []
    for module in modules.values():
        rel = module.path.relative_to(root)
        if rel.parts[0] != "analysis" or rel.parts[:2] == ("analysis", "kernels"):
            continue
        for number, line in enumerate(module.path.read_text().splitlines(), 1):
            if pattern.search(line):
                places.append(f"{rel}:{number}")
    return places


def radon_grades(root: Path) -> Counter[str]:
    """radon's cyclomatic-complexity grades C or worse over the product's folders."""
    out = subprocess.run(
        [sys.executable, "-m", "radon", "cc", "-n", "C", "-j", "kvformat", "capture", "analysis", "kvsnap"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    grades: Counter[str] = Counter()
    for blocks in json.loads(out).values():
        for block in blocks:
            if isinstance(block, dict):
                grades[block["rank"]] += 1
    return grades


def report(root: Path) -> dict[str, object]:
    modules = build(root)
    import_kvformat_public = public_modules(root)
    local, total = stage_imports(root, modules, "analysis")
    kvformat_out = sorted(
        {t for m in modules.values() if m.name.startswith("kvformat") for t, _ in m.imports}
        - {m for m in modules if m.startswith("kvformat")}
    )
    return {
        "circles": circles(modules),
        "analysis imports up its layers": [f"{a} -> {b}" for a, b in analysis_upward(modules)],
        "analysis folder loops": analysis_folder_loops(modules),
        "kvformat imports of other stages": kvformat_out,
        "kvformat modules the stages reach": dict(kvformat_reached(modules, import_kvformat_public)),
        "analysis imports inside functions": local,
        "analysis imports": total,
        "backend-name string tests outside analysis/kernels": backend_string_tests(root, modules),
        "radon C or worse": dict(sorted(radon_grades(root).items())),
    }


def public_modules(root: Path) -> set[str]:
    """kvformat's documented public modules: its ``PUBLIC_MODULES`` (read from the source)."""
    tree = ast.parse((root / "kvformat" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "PUBLIC_MODULES" for t in node.targets
        ):
            return {f"kvformat.{name}" for name in ast.literal_eval(node.value)}
    return set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = report(args.root.resolve())
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for key, value in result.items():
        if isinstance(value, list | dict) and value:
            count = sum(value.values()) if isinstance(value, dict) else len(value)
            print(f"{key}: {count}")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                print(f"    {v if isinstance(k, int) else f'{k}: {v}'}")
        else:
            print(f"{key}: {value if not isinstance(value, list | dict) else 0}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
