"""The importers kvsnap knows: every module of `kvformat.importers` that defines ``IMPORTER`` (an
`Importer`), found by listing the package, and any a program adds with `register`. Nothing is
imported until an importer is asked for."""

from __future__ import annotations

import importlib
import os
import pkgutil

from kvformat.errors import InvalidArgumentError, UnknownNameError
from kvformat.importers.contract import Importer

PREFIX_BYTES = 64
"""How much of a file's beginning an importer's `Importer.recognises` is given."""

_ADDED: dict[str, Importer] = {}
_NOT_FORMATS = {"contract", "registry"}


def register(importer: Importer) -> None:
    """Add ``importer`` (a format defined outside `kvformat.importers`); a later one of the same
    name replaces it."""
    _ADDED[importer.name] = importer


def importers() -> dict[str, Importer]:
    """Every importer by name: the package's modules' ``IMPORTER``, in module order, then those
    added with `register`."""
    package = importlib.import_module("kvformat.importers")
    found: dict[str, Importer] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name in _NOT_FORMATS:
            continue
        importer = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "IMPORTER", None)
        if isinstance(importer, Importer):
            found[importer.name] = importer
    return found | _ADDED


def by_magic(prefix: bytes) -> Importer | None:
    """The importer whose magic bytes begin ``prefix``, or None (what a `.kv` reader checks
    before calling a file corrupt)."""
    return next(
        (i for i in importers().values() if any(prefix.startswith(m) for m in i.magics)),
        None,
    )


def for_source(source: str | os.PathLike[str], name: str | None = None) -> Importer:
    """The importer for ``source``: the one named ``name``, else the first that recognises the
    file's first bytes; `UnknownNameError` naming the formats when none does."""
    known = importers()
    if name is not None:
        if name not in known:
            raise UnknownNameError(f"no importer named {name!r}; one of {', '.join(known)}")
        return known[name]
    with open(source, "rb") as file:
        prefix = file.read(PREFIX_BYTES)
    for importer in known.values():
        if importer.recognises(prefix):
            return importer
    formats = "; ".join(f"{i.name}: {i.description}" for i in known.values())
    raise InvalidArgumentError(f"{os.fspath(source)}: not a format kvsnap imports ({formats})")
