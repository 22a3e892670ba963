"""Per-head statistics of K and V: the entry points (rows, Arrow tables per layer, Polars frames,
many files on many cores), built on one streaming pass per file (`analysis.streaming`) feeding
mergeable accumulators (`analysis.accumulator`) of the statistics `analysis.catalogue` defines.
The formulas are in ``analysis/README.md``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

import kvformat

from .accumulator import HeadAccumulator
from .catalogue import (
    ALL,
    GROUPS,
    POSITION_BINS,
    QUANT_BITS,
    QUANT_GROUP,
    RANKS,
    TOP_K,
    stat_groups,
)
from .files import BatchOptions
from .parallel import local_map
from .plan import BACKENDS, Key, PassOptions, check_backend
from .streaming import accumulate, layers
from .tokens import token_ids, token_pieces

if TYPE_CHECKING:
    import polars as pl
    import pyarrow as pa

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
    "head_stats",
    "head_stats_reader",
    "layer_tables",
    "local_map",
    "merged_accumulators",
    "outliers",
    "stat_groups",
    "stats_for_file",
    "stats_rows",
    "token_table",
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
    options = PassOptions(snapshot, keys, stat_groups(stats), jobs, backend=backend)
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
    options = PassOptions(snapshot, keys, stat_groups(stats), jobs, storage_options, backend=backend)
    yield from layer_tables(path, options, progress)


def layer_tables(
    path: str | os.PathLike[str], options: PassOptions, progress: bool = False
) -> Iterator[pa.Table]:
    """`stats_for_file` with its options as one `PassOptions` (what the engines call)."""

    for name, index, _, accumulators in layers(path, options, progress, finish=True):
        yield _arrow_table(_rows(name, index, accumulators, arrays=True))


def _arrow_table(rows: list[dict[str, Any]]) -> pa.Table:
    """``pa.Table.from_pylist(rows)``, built column by column from numpy buffers (6x faster: lists
    of floats go in as one flat array and offsets; and ``pa.array`` is not called for the usual
    columns, whose first call imports pandas where it is installed: ~0.4 s of every ``kvsnap
    stats``). Columns: every key of every row, in first-seen order."""
    import pyarrow as pa

    names = list(dict.fromkeys(key for row in rows for key in row))
    return pa.table({name: _arrow_column([row.get(name) for row in rows]) for name in names})


def _arrow_column(values: list[Any]) -> pa.Array:
    """What ``pa.array(values)`` gives for a column of ints, floats (None for nulls), strings,
    Nones, or lists of floats or of ints, made from numpy buffers; anything else through
    ``pa.array``. 1-D float64 or int64 numpy arrays stand for lists of their values."""
    import pyarrow as pa

    kinds = set(map(type, values))
    n = len(values)
    if np.ndarray in kinds:
        if kinds == {np.ndarray} and len({(v.ndim, v.dtype) for v in values}) == 1:
            first = values[0]
            child = {np.dtype(np.float64): pa.float64(), np.dtype(np.int64): pa.int64()}.get(first.dtype)
            if first.ndim == 1 and child is not None:
                built = _list_array(child, [v.shape[0] for v in values], lambda: np.concatenate(values))
                if built is not None:
                    return built
        values = [v.tolist() if isinstance(v, np.ndarray) else v for v in values]
        kinds = set(map(type, values))
    if kinds == {int}:
        return _numeric(pa.int64(), np.array(values, np.int64), None)
    if kinds <= {float, type(None)} and float in kinds:
        valid = np.array([v is not None for v in values])
        data = np.array([v if v is not None else 0.0 for v in values], np.float64)
        return _numeric(pa.float64(), data, None if valid.all() else valid)
    if kinds == {type(None)}:
        return pa.nulls(n)
    if kinds == {str}:
        encoded = [v.encode() for v in values]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        if offsets[-1] < 2**31:
            buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(encoded))]
            return pa.Array.from_buffers(pa.string(), n, buffers)
    if kinds == {list}:
        items = set(map(type, itertools.chain.from_iterable(values)))
        child = {frozenset({float}): pa.float64(), frozenset({int}): pa.int64()}.get(frozenset(items))
        if child is not None:
            numpy_type = np.float64 if child == pa.float64() else np.int64
            lengths = [len(v) for v in values]
            built = _list_array(
                child,
                lengths,
                lambda: np.fromiter(itertools.chain.from_iterable(values), numpy_type, sum(lengths)),
            )
            if built is not None:
                return built
    return pa.array(values)


def _list_array(child: pa.DataType, lengths: list[int], flat: Callable[[], np.ndarray]) -> pa.Array | None:
    """A list array of ``child`` items, ``lengths`` per row, over the values ``flat()`` makes;
    None when the values pass 32-bit offsets."""
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        return None
    index = _numeric(pa.int32(), offsets.astype(np.int32), None)
    return pa.ListArray.from_arrays(index, _numeric(child, flat(), None))


def _numeric(kind: pa.DataType, data: np.ndarray, valid: np.ndarray | None) -> pa.Array:
    """An Arrow array of ``kind`` over ``data`` (contiguous, that type's width), nulls where
    ``valid`` is False."""
    import pyarrow as pa

    bitmap = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    nulls = 0 if valid is None else int(np.count_nonzero(~valid))
    return pa.Array.from_buffers(kind, data.shape[0], [bitmap, pa.py_buffer(data)], null_count=nulls)


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
    that `analysis.batch.merged_stats` combines across files."""
    options = PassOptions(snapshot, keys, stat_groups(stats), jobs, storage_options, backend=backend)
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


def file_table(path: str | os.PathLike[str], options: PassOptions) -> pa.Table:
    """Every layer's table of one file, concatenated (what the engines call per file)."""
    import pyarrow as pa

    tables = list(layer_tables(path, options, options.progress))
    return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})


def _paths(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str | os.PathLike[str]]:
    return [paths] if isinstance(paths, str | os.PathLike) else list(paths)


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
    process's): files in parallel processes first, the rest as each file's workers; with
    ``backend="mlx"`` one file after another, on mlx's device. ``progress`` is called with each
    file name as it finishes."""
    files = _paths(paths)
    batch = BatchOptions(jobs=jobs, snapshot=snapshot, keys=keys, stats=stat_groups(stats), backend=backend)
    processes, options = batch.plan(len(files))
    for path, table in zip(files, local_map(file_table, files, processes, options), strict=True):
        if progress:
            progress(os.fspath(path))
        yield table


def head_stats(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    backend: str = "cpu",
) -> pl.DataFrame:
    """A Polars DataFrame, one row per (file, seq, layer, head, tensor); ``keys="pre_rope"``
    un-rotates K first using the RoPE description in the metadata; ``stats`` names the groups
    (`GROUPS`; default all); ``jobs`` cores (default: all); ``backend="mlx"`` computes on mlx's
    default device (a GPU where there is one); ``progress`` is called with each file name as it
    finishes."""
    return frame_of(list(file_tables(paths, snapshot, keys, jobs, progress, stats=stats, backend=backend)))


def frame_of(tables: list[pa.Table]) -> pl.DataFrame:
    """One Polars DataFrame of Arrow tables (columns unified, empty tables dropped)."""
    import polars as pl
    import pyarrow as pa

    tables = [t for t in tables if t.num_rows]
    if not tables:
        return pl.DataFrame()
    frame = pl.from_arrow(pa.concat_tables(tables, promote_options="default"))
    assert isinstance(frame, pl.DataFrame)
    return frame


def head_stats_reader(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    *,
    stats: str | Iterable[str] | None = None,
) -> pa.RecordBatchReader:
    """The same rows as an Arrow RecordBatchReader, one batch per file (streams file by file)."""
    import pyarrow as pa

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


def token_table(
    path: str | os.PathLike[str], snapshot: int = -1, storage_options: dict[str, Any] | None = None
) -> pl.LazyFrame:
    """Per-token scalars as a LazyFrame, built chunk by chunk: seq, layer, head, position,
    k_norm, v_norm, k_absmax, k_nonfinite and v_nonfinite (how many of the row's values are inf
    or NaN; the row's norms are then null), and where the file records them (SPEC 15.3)
    ``token_id`` and ``token_text`` (the token decoded alone), null where it does not."""
    import polars as pl

    frames = []
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        ids, pieces = token_ids(snap), token_pieces(snap)

        def label(values: list[list[Any]] | None, seq: int, positions: np.ndarray) -> list[Any]:
            known = values[seq] if values is not None and seq < len(values) else []
            return [known[p] if p < len(known) else None for p in positions.tolist()]

        def scalar(values: np.ndarray, bad: np.ndarray) -> pl.Series:
            return pl.Series(np.where(bad > 0, np.nan, values)).fill_nan(None)

        for block in snap.blocks():
            k = np.asarray(block.k, dtype=np.float32)
            v = np.asarray(block.v, dtype=np.float32)
            k_bad = (~np.isfinite(k)).sum(axis=1)
            v_bad = (~np.isfinite(v)).sum(axis=1)
            with np.errstate(all="ignore"):
                k_norm, v_norm = np.linalg.norm(k, axis=1), np.linalg.norm(v, axis=1)
                k_absmax = np.abs(k).max(axis=1) if k.size else np.empty(0, np.float32)
            frames.append(
                pl.DataFrame(
                    {
                        "seq": np.full(block.positions.size, block.seq, np.int32),
                        "layer": np.full(block.positions.size, block.layer, np.int32),
                        "head": np.full(block.positions.size, block.head, np.int32),
                        "position": block.positions,
                        "k_norm": scalar(k_norm, k_bad),
                        "v_norm": scalar(v_norm, v_bad),
                        "k_absmax": scalar(k_absmax, k_bad),
                        "k_nonfinite": k_bad.astype(np.int32),
                        "v_nonfinite": v_bad.astype(np.int32),
                        "token_id": pl.Series(label(ids, block.seq, block.positions), dtype=pl.Int64),
                        "token_text": pl.Series(label(pieces, block.seq, block.positions), dtype=pl.Utf8),
                    }
                )
            )
    if not frames:
        return pl.LazyFrame()
    return pl.concat(frames).lazy()


def outliers(
    table: pl.DataFrame, factor: float = 1.5, stat: str = "norm_mean", tensor: str = "k"
) -> pl.DataFrame:
    """The ``tensor`` rows with ``ratio_to_median`` (``stat`` / the median head of its file) and
    an ``outlier`` flag where it exceeds ``factor``. NaN and null values (a head whose every
    row held inf or NaN) take no part in the median and are never flagged."""
    import polars as pl

    rows = table.filter(pl.col("tensor") == tensor)
    value = pl.col(stat).cast(pl.Float64).fill_nan(None)
    ratio = (value / value.median().over("file")).alias("ratio_to_median")
    return rows.with_columns(ratio).with_columns((pl.col("ratio_to_median") > factor).alias("outlier"))
