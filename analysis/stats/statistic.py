"""A statistic added to the catalogue, declared once: its column, its group, the sums it keeps,
how rows add into them and how its value follows from them. Every kernel (``cpu``, ``numpy``,
``mlx``) then computes it, the running sums carry it across chunks, files, processes and
`--merge`, and it is a column of every table (`kvsnap stats`, `head_stats`), a choice of
``--stat`` and of `kvsnap outliers`.

Where the statistics come from: every module of `analysis.stats.added` that defines
``STATISTIC`` (a `Statistic`, or a tuple of them), and every entry point of the group
``kvsnap.statistics`` in an installed package (``name = "package.module:STATISTIC"``): a
statistic of your own is one module and one line of your package's metadata, seen by every
process a pass starts. The catalogue's own statistics (`catalogue.GROUPS`) are computed by the
fused kernels; an added one is computed in float64 by its `Statistic.add`, beside the kernel,
over the same finite rows (rows holding inf or NaN are left out of it as of the kernel's sums).

Example (a module of ``analysis/stats/added/``, or of your own package)::

    def add_zeros(sums, rows, positions):
        sums["zero_count"] += np.count_nonzero(rows == 0)

    def zero_fraction(sums):
        return float(sums["zero_count"]) / (sums["count"] * sums["dim"])

    STATISTIC = Statistic(
        name="zero_fraction",
        group="norms",
        sums=(Sum("zero_count", "add", frozenset({"norms"}), dtype="int64"),),
        add=add_zeros,
        value=zero_fraction,
    )

An added statistic costs a float64 numpy pass over each piece of rows beside the kernel's own;
one that every pass should have at the kernels' speed belongs in the kernels instead.
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dependencies import kvformat_errors
from ..errors import LayoutMismatchError
from .catalogue import SUMS, Sum, allocate
from .groups import ALWAYS, GROUPS, LIST_COLUMNS

ENTRY_POINTS = "kvsnap.statistics"
"""The entry-point group a package declares its statistics under."""

Adder = Callable[[Mapping[str, np.ndarray], np.ndarray, np.ndarray], None]
"""``add(sums, rows, positions)``: add ``rows`` ``(n, dim)`` float64 (finite) at ``positions``
``(n,)`` int64 into ``sums`` (the statistic's own sums by name, numpy arrays of their declared
shape, a number a 0-d array: add in place)."""

Value = Callable[[Mapping[str, Any]], Any]
"""``value(sums)``: the column's value for one head from ``sums``: the statistic's own sums and
the catalogue's (`catalogue.SUMS`: ``count``, ``norm_sum``, ``power`` ...) by name, plus ``dim``
(channels); a float (a scalar column) or a 1-D float64 array (``vector=True``). Called only for
a head that holds rows (``count`` > 0)."""


@dataclass(frozen=True)
class Statistic:
    """One added statistic (see the module's docstring): ``name`` its column (not one of the
    catalogue's), ``group`` the statistic group it is computed with (one of `catalogue.GROUPS`:
    ``--stats`` selects it with them), ``sums`` the running sums it keeps (`catalogue.Sum`;
    names unique across the catalogue; shapes of `catalogue.shape_of`'s axes: ``()``,
    ``("dim",)``, ``("dim", "dim")`` ...), ``add`` and ``value`` as `Adder` and `Value`,
    ``vector``: its value is a list per head."""

    name: str
    group: str
    sums: tuple[Sum, ...]
    add: Adder
    value: Value
    vector: bool = False
    description: str = ""


_RUNTIME: dict[str, Statistic] = {}


def register(statistic: Statistic) -> None:
    """Add ``statistic`` in this process alone (a pass on one process: ``jobs=1``, or a file too
    small for worker processes); a statistic every process sees is a module of
    `analysis.stats.added` or an entry point (see the module's docstring). A later one of the
    same name replaces it."""
    _check(statistic, {name: s for name, s in added().items() if name != statistic.name})
    _RUNTIME[statistic.name] = statistic
    added.cache_clear()


def unregister(name: str) -> None:
    """Take back a statistic added with `register`."""
    _RUNTIME.pop(name, None)
    added.cache_clear()


@functools.cache
def added() -> dict[str, Statistic]:
    """Every added statistic by name: `analysis.stats.added`'s, then the entry points', then
    those of `register`; an invalid declaration raises `InvalidArgumentError` naming it."""
    found: dict[str, Statistic] = {}
    for statistic in (*_package(), *_entry_points(), *_RUNTIME.values()):
        _check(statistic, found)
        found[statistic.name] = statistic
    return found


def _declared(value: Any, where: str) -> list[Statistic]:
    statistics = list(value) if isinstance(value, (tuple, list)) else [value]
    for statistic in statistics:
        if not isinstance(statistic, Statistic):
            raise kvformat_errors.InvalidTypeError(f"{where}: {statistic!r} is not a Statistic")
    return statistics


def _package() -> list[Statistic]:
    package = importlib.import_module(f"{__package__}.added")
    found: list[Statistic] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(module, "STATISTIC"):
            found += _declared(module.STATISTIC, module.__name__)
    return found


def _declares_entry_points() -> bool:
    """Whether an installed package's metadata on ``sys.path`` names the group `ENTRY_POINTS`:
    a look at each ``*.dist-info/entry_points.txt`` (a millisecond or two), so that a pass where
    none does never imports `importlib.metadata` (tens of milliseconds of every command's start)."""
    marker = f"[{ENTRY_POINTS}]"
    for folder in sys.path:
        try:
            entries = [
                e.path for e in os.scandir(folder or ".") if e.name.endswith((".dist-info", ".egg-info"))
            ]
        except OSError:
            continue
        for info in entries:
            try:
                with open(os.path.join(info, "entry_points.txt"), encoding="utf-8") as file:
                    if marker in file.read():
                        return True
            except OSError:
                continue
    return False


def _entry_points() -> list[Statistic]:
    if not _declares_entry_points():
        return []
    import importlib.metadata

    found: list[Statistic] = []
    for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
        found += _declared(point.load(), f"entry point {point.value}")
    return found


def check_scalar(name: str, groups: frozenset[str]) -> None:
    """`UsageError` unless ``name`` is a one-number statistic (the catalogue's or an added one)
    the groups ``groups`` compute, naming what is wrong: a misspelling (the choices listed), a
    list column, or a group left out."""
    if name in ALWAYS:
        return
    owner, vector = _owner(name)
    if vector:
        raise kvformat_errors.InvalidArgumentError(
            f"--stat {name!r} holds a list per head; give a one-number statistic"
        )
    if owner not in groups:
        raise kvformat_errors.InvalidArgumentError(
            f"--stat {name!r} is in the {owner!r} group, which --stats leaves out"
        )


def _owner(name: str) -> tuple[str, bool]:
    """The group a statistic belongs to and whether it holds a list per head (the catalogue's
    or an added one's); `UnknownNameError` listing the one-number statistics otherwise."""
    owner = next((group for group, columns in GROUPS.items() if name in columns), None)
    if owner is not None:
        return owner, name in LIST_COLUMNS
    declared = added().get(name)
    if declared is None:
        scalars = [c for columns in GROUPS.values() for c in columns if c not in LIST_COLUMNS]
        scalars += [s.name for s in added().values() if not s.vector]
        raise kvformat_errors.UnknownNameError(
            f"--stat {name!r}: no such statistic; one of: {', '.join([*ALWAYS, *scalars])}"
        )
    return declared.group, declared.vector


_CATALOGUE_SUMS = frozenset(total.name for total in SUMS)


def _check(statistic: Statistic, others: Mapping[str, Statistic]) -> None:
    """`InvalidArgumentError` where ``statistic`` would clash with the catalogue or ``others``."""
    if statistic.group not in GROUPS:
        raise kvformat_errors.UnknownNameError(
            f"statistic {statistic.name!r}: no group {statistic.group!r}; one of {', '.join(GROUPS)}"
        )
    builtin = {*ALWAYS, *(column for columns in GROUPS.values() for column in columns)}
    where = f"statistic {statistic.name!r}"
    if not statistic.name.isidentifier() or statistic.name in builtin:
        raise kvformat_errors.InvalidArgumentError(
            f"{where}: the name is not an identifier, or is the catalogue's"
        )
    if statistic.name in others:
        raise kvformat_errors.InvalidArgumentError(f"{where} is declared twice")
    _check_sums(statistic, others, where)


def _check_sums(statistic: Statistic, others: Mapping[str, Statistic], where: str) -> None:
    """Its sums named apart from the catalogue's and ``others``', each merged by add, min or max."""
    taken = _CATALOGUE_SUMS | {s.name for other in others.values() for s in other.sums}
    for total in statistic.sums:
        if total.name in taken or total.name == "dim":
            raise kvformat_errors.InvalidArgumentError(f"{where}: its sum {total.name!r} is declared already")
        if total.merge not in ("add", "min", "max"):
            raise kvformat_errors.InvalidArgumentError(
                f"{where}: sum {total.name!r} merges by {total.merge!r}; one of add, min, max"
            )


def active(groups: frozenset[str]) -> tuple[Statistic, ...]:
    """The added statistics computed with the statistic ``groups`` (empty, and cheap, where none
    is added)."""
    return _active(groups, tuple(added().values()))


@functools.cache
def _active(groups: frozenset[str], statistics: tuple[Statistic, ...]) -> tuple[Statistic, ...]:
    return tuple(s for s in statistics if s.group in groups)


def allocated(statistics: Iterable[Statistic], dim: int) -> dict[str, np.ndarray]:
    """Fresh sums of ``statistics`` for ``dim`` channels, by name: a min sum starts at +inf,
    a max sum at -inf, an add sum at 0."""
    sums: dict[str, np.ndarray] = {}
    for statistic in statistics:
        for total in statistic.sums:
            value = np.asarray(allocate(total, dim, None, frozenset()), total.dtype)
            if total.merge != "add":
                value[...] = np.inf if total.merge == "min" else -np.inf
            sums[total.name] = value
    return sums


def add(
    statistics: Iterable[Statistic], sums: Mapping[str, np.ndarray], rows: np.ndarray, positions: np.ndarray
) -> None:
    """Add ``rows`` ``(n, dim)`` at ``positions`` into each statistic's ``sums`` (in float64;
    rows holding inf or NaN left out)."""
    x = np.asarray(rows, np.float64)
    finite = np.isfinite(x).all(axis=1)
    if not finite.all():
        x, positions = x[finite], np.asarray(positions)[finite]
    if not x.shape[0]:
        return
    positions = np.asarray(positions, np.int64)
    for statistic in statistics:
        statistic.add({total.name: sums[total.name] for total in statistic.sums}, x, positions)


def merge(
    statistics: Iterable[Statistic], mine: dict[str, np.ndarray], theirs: Mapping[str, np.ndarray]
) -> None:
    """Combine ``theirs`` into ``mine`` by each sum's merge rule (in place)."""
    for statistic in statistics:
        for total in statistic.sums:
            if mine[total.name].shape != theirs[total.name].shape:
                raise LayoutMismatchError(f"cannot merge sum {total.name!r}: shapes differ")
            combine = {"add": np.add, "min": np.minimum, "max": np.maximum}[total.merge]
            combine(mine[total.name], theirs[total.name], out=mine[total.name])


def values(statistics: Iterable[Statistic], sums: Mapping[str, Any]) -> dict[str, Any]:
    """Each statistic's column value from ``sums`` (see `Value`)."""
    row: dict[str, Any] = {}
    for statistic in statistics:
        value = statistic.value(sums)
        row[statistic.name] = np.asarray(value, np.float64) if statistic.vector else float(value)
    return row
