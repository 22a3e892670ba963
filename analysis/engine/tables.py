"""Per-head statistics of K and V as tables: rows, Arrow tables per layer, Polars frames, many
files on many cores, built on one streaming pass per file (`engine.streaming`) feeding mergeable
accumulators (`engine.accumulator`) of the statistics `stats.catalogue` defines. The formulas are
in ``analysis/README.md``; the public front doors are re-exported by `kvsnap.analysis`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..dependencies import pa, pl
from ..kernels import CHOICES as BACKENDS
from ..kernels import check as check_backend
from ..stats.arrow import arrow_table
from ..stats.catalogue import ALL, GROUPS, POSITION_BINS, QUANT_BITS, QUANT_GROUP, RANKS, TOP_K, stat_groups
from .accumulator import HeadAccumulator
from .files import expand_paths, parts_by_file
from .plan import BatchOptions, Key, PassOptions
from .streaming import accumulate, layers

__all__ = [
    "ALL",
    "BACKENDS",
    "GROUPS",
    "POSITION_BINS",
    "QUANT_BITS",
    "QUANT_GROUP",
    "RANKS",
    "TOP_K",
    "HeadAccumulator",
    "Key",
    "PassOptions",
    "check_backend",
    "file_accumulators",
    "file_table",
    "file_tables",
    "frame_of",
    "head_stats_reader",
    "head_stats_table",
    "layer_tables",
    "merged_accumulators",
    "stat_groups",
    "stats_for_file",
    "stats_rows",
]


def _rows(
    name: str, index: int, accumulators: dict[Key, HeadAccumulator], arrays: bool = False
) -> list[dict[str, Any]]:
    """One row per accumulator, within a layer by (seq, head, tensor); vector columns as numpy
    arrays with ``arrays`` (for `_arrow_table`), else lists."""
    return [
        {
            "file": name,
            "snapshot": index,
            "seq": seq,
            "layer": layer,
            "head": head,
            "tensor": tensor,
            **(acc.row_arrays() if arrays else acc.row()),
        }
        for (layer, seq, head, tensor), acc in sorted(accumulators.items())
    ]


def stats_rows(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    keys: str = "post_rope",
    *,
    stats: str | Iterable[str] | None = None,
    jobs: int = 1,
    backend: str = "cpu",
) -> list[dict[str, Any]]:
    """Rows of per-head statistics for one file (one streaming pass on ``jobs`` workers, or mlx
    with ``backend="mlx"``), as dicts: within a layer by (seq, head, tensor)."""
    options = PassOptions(
        snapshot=snapshot, keys=keys, stats=stat_groups(stats), workers=jobs, backend=backend
    )
    return [
        row
        for name, index, _, table in layers(path, options, finish=True)
        for row in _rows(name, index, table)
    ]


def stats_for_file(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    keys: str = "post_rope",
    storage_options: dict[str, Any] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    jobs: int = 1,
    progress: bool = False,
    backend: str = "cpu",
) -> Iterator[pa.Table]:
    """The per-head statistics of one file (a path or a URL) as Arrow tables, one per layer, each
    yielded as soon as the streaming pass is past that layer's last chunk; ``stats`` picks the
    groups (`GROUPS`, all by default), ``jobs`` workers share the file (processes; threads for a
    URL). No global state but the kept worker pool: a process pool or a distributed engine can
    call it per file."""
    options = PassOptions(
        snapshot=snapshot,
        keys=keys,
        stats=stat_groups(stats),
        workers=jobs,
        storage_options=storage_options,
        backend=backend,
    )
    yield from layer_tables(path, options, progress)


def layer_tables(
    path: str | os.PathLike[str], options: PassOptions, progress: bool = False
) -> Iterator[pa.Table]:
    """`stats_for_file` with its options as one `PassOptions` (what the engines call)."""

    for name, index, _, accumulators in layers(path, options, progress, finish=True):
        yield arrow_table(_rows(name, index, accumulators, arrays=True))


def file_accumulators(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    keys: str = "post_rope",
    storage_options: dict[str, Any] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    jobs: int = 1,
    backend: str = "cpu",
) -> dict[tuple[int, int, str], HeadAccumulator]:
    """The mergeable state of one file, per (layer, head, tensor), its sequences merged: the unit
    that `analysis.engine.batch.merged_stats` combines across files."""
    options = PassOptions(
        snapshot=snapshot,
        keys=keys,
        stats=stat_groups(stats),
        workers=jobs,
        storage_options=storage_options,
        backend=backend,
    )
    return merged_accumulators(path, options)


def merged_accumulators(
    path: str | os.PathLike[str], options: PassOptions
) -> dict[tuple[int, int, str], HeadAccumulator]:
    """`file_accumulators` with its options as one `PassOptions` (what the engines call)."""
    merged: dict[tuple[int, int, str], HeadAccumulator] = {}
    for (layer, _, head, tensor), acc in sorted(accumulate(path, options).items()):
        key = (layer, head, tensor)
        if key in merged:
            merged[key].merge(acc)
        else:
            merged[key] = acc
    return merged


def file_table(
    path: str | os.PathLike[str], options: PassOptions, sink: Callable[[pa.Table], None] | None = None
) -> pa.Table:
    """Every layer's table of one file, concatenated (what the engines call per file); ``sink``,
    in this process, takes each layer's table as soon as it is computed. Without a sink, the
    rows of every layer become one table at the end: one Arrow build per file, not one per
    layer (`python -m benchmarks.analysis_bench` times a pass)."""
    # pyarrow after the pass has started (its first table imports it while the workers run):
    # imported first, it would hold up the tasks' submission by its import.
    if sink is None:
        rows = [
            row
            for name, index, _, accumulators in layers(path, options, options.progress, finish=True)
            for row in _rows(name, index, accumulators, arrays=True)
        ]

        return arrow_table(rows) if rows else pa.table({})
    tables = []
    for table in layer_tables(path, options, options.progress):
        tables.append(table)
        sink(table)

    return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})


def _paths(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str]:
    """The files of ``paths``: paths, URLs and patterns (``runs/*.kv``, `expand_paths`)."""
    given = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    return expand_paths([os.fspath(p) for p in given])


def file_tables(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    backend: str = "cpu",
) -> Iterator[pa.Table]:
    """One Arrow table per file, in the order given, on ``jobs`` cores (default: all of this
    process's): files in parallel processes first (in parts of their layers where each would get
    one core, `plan.file_parts`), the rest as each file's workers; with
    ``backend="mlx"`` one file after another, on mlx's device. ``progress`` is called with each
    file name as it finishes."""
    files = _paths(paths)
    batch = BatchOptions(jobs=jobs, snapshot=snapshot, keys=keys, stats=stat_groups(stats), backend=backend)
    for path, found in parts_by_file(batch.plan(files), file_table):
        if progress:
            progress(os.fspath(path))
        yield found[0] if len(found) == 1 else rows_of(found)


def head_stats_table(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    backend: str = "cpu",
) -> pa.Table:
    """The rows of `analysis.head_stats` (files in this process, no batch engine) as one Arrow
    table, without importing polars: what the commands that print rows use."""
    return rows_of(list(file_tables(paths, snapshot, keys, jobs, progress, stats=stats, backend=backend)))


def frame_of(tables: list[pa.Table]) -> pl.DataFrame:
    """One Polars DataFrame of Arrow tables (columns unified, empty tables dropped)."""

    frame = pl.from_arrow(rows_of(tables))
    assert isinstance(frame, pl.DataFrame)
    return frame


def rows_of(tables: list[pa.Table]) -> pa.Table:
    """One Arrow table of ``tables`` (columns unified, empty tables dropped; no columns if none
    is left)."""

    tables = [t for t in tables if t.num_rows]
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default")


def head_stats_reader(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    *,
    stats: str | Iterable[str] | None = None,
) -> pa.RecordBatchReader:
    """The same rows as an Arrow RecordBatchReader, one batch per file (streams file by file)."""

    tables = file_tables(paths, snapshot, keys, jobs, stats=stats)
    first = next(tables, None)
    if first is None:
        return pa.RecordBatchReader.from_batches(pa.schema([]), iter(()))
    schema = first.schema

    def batches() -> Iterator[pa.RecordBatch]:
        yield from first.cast(schema).to_batches()
        for table in tables:
            yield from table.cast(schema).to_batches()

    return pa.RecordBatchReader.from_batches(schema, batches())
