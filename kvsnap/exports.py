"""A package's public names, imported on first use (PEP 562) and declared once, as the imports of
its ``if TYPE_CHECKING:`` block, which type checkers read as they are:

    if TYPE_CHECKING:
        from .engine.tables import head_stats, head_stats_table
        from kvformat import KVSnapError as Error
        from . import analysis

    __all__ = ["Error", "analysis", "head_stats", "head_stats_table"]
    __getattr__, __dir__ = exports(__name__, __file__, __all__)

`exports` reads those imports from the package's source (``__init__.py``) and checks them against
``__all__`` (the literal linters read): a name in one and not the other is an `ImportError` when
the package is imported. A name is imported when first read (``kvsnap.analysis.head_stats``
loads `kvsnap.analysis.engine.tables` then, not when `kvsnap.analysis` is imported) and kept in
the package's namespace from then on.
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def exports(
    package: str, init: str, names: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (its ``__init__.py`` at ``init``), which
    exports ``names`` (its ``__all__``) as its ``TYPE_CHECKING`` block imports them."""
    sources = typing_imports(package, Path(init).read_text(encoding="utf-8"))
    if differ := sorted(set(sources) ^ set(names)):
        raise ImportError(f"{package}: __all__ and its TYPE_CHECKING imports differ in {differ}")

    def __getattr__(name: str) -> Any:
        if name not in sources:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = sources[name]
        if attribute is None:
            value: Any = importlib.import_module(module)
        else:
            value = getattr(importlib.import_module(module), attribute)
            if isinstance(value, types.ModuleType):
                # A submodule of the same name, imported before: the
                # package attribute is then that module; the name is the module's attribute.
                value = getattr(value, attribute)
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*names, *vars(sys.modules[package])})

    return __getattr__, __dir__


def typing_imports(package: str, source: str) -> dict[str, tuple[str, str | None]]:
    """Each name the ``if TYPE_CHECKING:`` block of ``package``'s ``source`` imports: the module it
    comes from and its attribute there (None for a submodule, ``from . import x``)."""
    found: dict[str, tuple[str, str | None]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                if not isinstance(statement, ast.ImportFrom):
                    raise ImportError(f"{package}: its TYPE_CHECKING block holds {ast.unparse(statement)!r}")
                found.update(_names(package, statement))
    return found


def _names(package: str, statement: ast.ImportFrom) -> dict[str, tuple[str, str | None]]:
    """What one ``from ... import ...`` of ``package``'s ``__init__`` names (see `typing_imports`)."""
    if statement.level:  # relative to the package (level 1: the package itself)
        parts = package.split(".")[: len(package.split(".")) - statement.level + 1]
        module = ".".join([*parts, *([statement.module] if statement.module else [])])
    else:
        module = statement.module or ""
    if statement.module is None:  # from . import submodule
        return {alias.asname or alias.name: (f"{module}.{alias.name}", None) for alias in statement.names}
    return {alias.asname or alias.name: (module, alias.name) for alias in statement.names}
