"""Statistics rows as Arrow tables, column by column from numpy buffers.

``pa.Table.from_pylist(rows)`` is the reference (tests hold the two equal); building from buffers
is faster (lists of floats go in as one flat array and offsets) and never calls ``pa.array``
for the usual columns, whose first call imports pandas where it is installed, a cost every
``kvsnap stats`` would pay (`python -m benchmarks.cli_bench`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dependencies import pa


def arrow_table(rows: list[dict[str, Any]]) -> pa.Table:
    """``pa.Table.from_pylist(rows)``: columns are every key of every row, in first-seen order."""

    names = list(dict.fromkeys(key for row in rows for key in row))
    return pa.table({name: arrow_column([row.get(name) for row in rows]) for name in names})


def arrow_column(values: list[Any]) -> pa.Array:
    """What ``pa.array(values)`` gives for a column of ints, floats (None for nulls), strings,
    Nones, or lists of floats or of ints, made from numpy buffers; anything else through
    ``pa.array``. 1-D float64 or int64 numpy arrays stand for lists of their values."""

    kinds = set(map(type, values))
    if np.ndarray in kinds:
        built = _from_arrays(values) if kinds == {np.ndarray} else None
        if built is not None:
            return built
        values = [v.tolist() if isinstance(v, np.ndarray) else v for v in values]
        kinds = set(map(type, values))
    if kinds == {list}:
        built = _from_lists(values)
    elif kinds == {str}:
        built = _from_strings(values)
    else:
        built = _from_scalars(values, kinds)
    return built if built is not None else pa.array(values)


def _from_arrays(values: list[np.ndarray]) -> pa.Array | None:
    """A list column from 1-D float64 or int64 arrays of one dtype; None for anything else."""

    if len({(v.ndim, v.dtype) for v in values}) != 1:
        return None
    first = values[0]
    child = {np.dtype(np.float64): pa.float64(), np.dtype(np.int64): pa.int64()}.get(first.dtype)
    if first.ndim != 1 or child is None:
        return None
    return _list_array(child, [v.shape[0] for v in values], lambda: np.concatenate(values))


def _from_scalars(values: list[Any], kinds: set[type]) -> pa.Array | None:
    """A bool column from bools, int64 from ints, float64 from floats and Nones (nulls), a null
    column from Nones; None for other mixes."""

    if kinds == {bool}:  # a bitmap, least significant bit first (`pa.array` would import pandas)
        bits = np.packbits(np.array(values, np.bool_), bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits.tobytes())])
    if kinds == {int}:
        return _numeric(pa.int64(), np.array(values, np.int64), None)
    if kinds <= {float, type(None)} and float in kinds:
        valid = np.array([v is not None for v in values])
        data = np.array([v if v is not None else 0.0 for v in values], np.float64)
        return _numeric(pa.float64(), data, None if valid.all() else valid)
    if kinds == {type(None)}:
        return pa.nulls(len(values))
    return None


def _from_strings(values: list[str]) -> pa.Array | None:
    """A string column (UTF-8, 32-bit offsets); None past 2 GiB of text."""

    encoded = [v.encode() for v in values]
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    if offsets[-1] >= 2**31:
        return None
    buffers = [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(b"".join(encoded))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers)


def _from_lists(values: list[list[Any]]) -> pa.Array | None:
    """A list column from lists of floats or lists of ints; None for other items."""

    items = set(map(type, itertools.chain.from_iterable(values)))
    child = {frozenset({float}): pa.float64(), frozenset({int}): pa.int64()}.get(frozenset(items))
    if child is None:
        return None
    numpy_type = np.float64 if child == pa.float64() else np.int64
    lengths = [len(v) for v in values]
    return _list_array(
        child,
        lengths,
        lambda: np.fromiter(itertools.chain.from_iterable(values), numpy_type, sum(lengths)),
    )


def _list_array(child: pa.DataType, lengths: list[int], flat: Callable[[], np.ndarray]) -> pa.Array | None:
    """A list array of ``child`` items, ``lengths`` per row, over the values ``flat()`` makes;
    None when the values pass 32-bit offsets."""

    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 2**31:
        return None
    index = _numeric(pa.int32(), offsets.astype(np.int32), None)
    return pa.ListArray.from_arrays(index, _numeric(child, flat(), None))


def _numeric(kind: pa.DataType, data: np.ndarray, valid: np.ndarray | None) -> pa.Array:
    """An Arrow array of ``kind`` over ``data`` (contiguous, that type's width), nulls where
    ``valid`` is False."""

    bitmap = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    nulls = 0 if valid is None else int(np.count_nonzero(~valid))
    return pa.Array.from_buffers(kind, data.shape[0], [bitmap, pa.py_buffer(data)], null_count=nulls)
