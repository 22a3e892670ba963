"""Queries (format 1.3, SPEC sections 10.1 and 11.1): Q chunks, which snapshot holds which, and
one query head's rows read back; and sparse attention's key selections (format 1.7), which
snapshots hold as they hold queries.

A snapshot's queries are its parent's plus the Q chunks its ``queries`` ranges name (queries are
never dropped: the query at position ``p`` is what attention used when ``p`` was processed).
Materialized here, apart from the K/V runs of `kvformat.series`, and checked on first use: every
range names Q chunks of the file, and no (layer, seq, query head) holds a position twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvformat.errors import CorruptFileError
from kvformat.layout import KIND_Q, KIND_SELECTION
from kvformat.runs import ranges
from kvformat.series import Entry

if TYPE_CHECKING:
    from kvformat.structure import FileStructure


@dataclass(frozen=True)
class Queries:
    """The queries of one query head of one layer for one sequence, in position order:
    ``q`` ``(n_queries, dim)`` in the stored dtype (post-RoPE, as the attention kernel received
    them), ``positions`` ``(n_queries,)`` int64 absolute positions."""

    layer: int
    head: int
    seq: int
    q: np.ndarray
    positions: np.ndarray


@dataclass(frozen=True)
class Selection:
    """The key selections of one layer for one sequence (format 1.7, sparse attention), in
    position order: ``rows`` ``(n, width)`` int32, row ``i`` the key positions (increasing) the
    queries at ``positions[i]`` may attend, shared by every query head of the layer;
    ``positions`` ``(n,)`` int64. A query position without a row attends every visible key."""

    layer: int
    seq: int
    rows: np.ndarray
    positions: np.ndarray


def query_chunks(entries: list[Entry], index: int) -> np.ndarray:
    """The Q chunk indices snapshot ``index`` holds: those of its parent chain, oldest first."""
    chain: list[np.ndarray] = []
    current: int | None = index
    seen = 0
    while current is not None:
        entry = entries[current]
        if entry.query_ranges.size:
            chain.append(entry.query_ranges)
        current = entry.parent
        seen += 1
        if seen > len(entries):  # parents are earlier snapshots, so this cannot happen
            raise CorruptFileError(f"snapshot {index}: its parents form a cycle")
    if not chain:
        return np.empty(0, np.int64)
    spans = np.concatenate(chain[::-1])
    return ranges(spans[:, 0], spans[:, 1] - spans[:, 0])


def check_queries(file: FileStructure, index: int) -> np.ndarray:
    """Snapshot ``index``'s Q and selection chunks, checked (SPEC R13 for ``queries``): inside
    the table, of kind Q or selection, no (layer, seq, head) position twice among the Q chunks
    nor (layer, seq) position twice among the selection chunks. Returns the chunk indices sorted
    by (layer, seq, kind, head, position)."""
    chunks = query_chunks(file.entries, index)
    if not chunks.size:
        return chunks
    n = len(file.table)
    if int(chunks.max()) >= n:
        raise CorruptFileError(
            f"snapshot {index}: 'queries' names chunk {int(chunks.max())}; the file has {n}"
        )
    table = file.table[chunks]
    named = (table["kind"] == KIND_Q) | (table["kind"] == KIND_SELECTION)
    if not bool(np.all(named)):
        bad = int(chunks[int(np.argmax(~named))])
        raise CorruptFileError(
            f"snapshot {index}: 'queries' names chunk {bad}, which is neither a Q nor a selection chunk"
        )
    layer, seq, head, kind = (table[f].astype(np.int64) for f in ("layer", "seq", "head", "kind"))
    position, rows = table["position"].astype(np.int64), table["rows"].astype(np.int64)
    order = np.lexsort((position, head, kind, seq, layer))
    chunks, layer, seq, head, kind, position, rows = (
        a[order] for a in (chunks, layer, seq, head, kind, position, rows)
    )
    held = rows > 0  # a chunk of 0 rows holds no position: it can hold none twice (SPEC 11.1)
    layer, seq, head, kind, position, rows = (a[held] for a in (layer, seq, head, kind, position, rows))
    same = (
        (layer[1:] == layer[:-1]) & (seq[1:] == seq[:-1]) & (head[1:] == head[:-1]) & (kind[1:] == kind[:-1])
    )
    twice = same & (position[1:] < position[:-1] + rows[:-1])
    if twice.any():
        i = int(np.argmax(twice)) + 1
        what = "a key selection for" if kind[i] == KIND_SELECTION else f"query head {int(head[i])}"
        raise CorruptFileError(
            f"snapshot {index}: layer {int(layer[i])} {what} seq {int(seq[i])} "
            f"holds query position {int(position[i])} twice"
        )
    return chunks


def check_all_queries(file: FileStructure) -> None:
    """`check_queries` for every snapshot of the file, in time linear in the index: a snapshot
    that is another's parent holds a subset of that one's queries, so only the snapshots that
    are no one's parent are materialized (the last one of a series)."""
    parents = {entry.parent for entry in file.entries}
    for index in range(len(file.entries)):
        if index not in parents:
            check_queries(file, index)


def read_queries(
    file: FileStructure, chunks: np.ndarray, layer: int, head: int, seq: int, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(q, positions)`` of one query head from the snapshot's checked ``chunks``, positions
    ``start <= p < stop``; ``q`` is ``(0, dim)`` when there are none."""
    spec = file.manifest.layers[layer].queries
    assert spec is not None
    table = file.table[chunks]
    mine = chunks[
        (table["layer"] == layer)
        & (table["seq"] == seq)
        & (table["head"] == head)
        & (table["kind"] == KIND_Q)
    ]
    return _rows_between(file, mine, start, stop, np.empty((0, spec.dim), spec.dtype.numpy))


def _rows_between(
    file: FileStructure,
    chunks: np.ndarray,
    start: int,
    stop: int,
    empty: np.ndarray,
    selections: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, positions)`` of ``chunks`` (in position order) at positions ``start <= p <
    stop``; ``empty`` where there are none; ``selections``: each chunk's rows checked
    (`check_selection_rows`)."""
    parts: list[np.ndarray] = []
    places: list[np.ndarray] = []
    checked = file.checked_selections
    for chunk in chunks.tolist():
        info = file.table[chunk]
        first, count = int(info["position"]), int(info["rows"])
        low, high = max(start, first), min(stop, first + count)
        if low >= high:
            continue
        rows = file.chunk_array(chunk)
        if selections and chunk not in checked:  # each chunk's rows checked once per open file
            check_selection_rows(rows, file.chunk_name(chunk))
            checked.add(chunk)
        parts.append(rows[low - first : high - first])
        places.append(np.arange(low, high, dtype=np.int64))
    if not parts:
        return empty, np.empty(0, np.int64)
    if len(parts) == 1:
        return parts[0], places[0]
    return np.concatenate(parts), np.concatenate(places)


def check_selection_rows(rows: np.ndarray, label: str) -> None:
    """`CorruptFileError` unless every row of a selection chunk ``rows`` ``(n, width)`` int32
    holds key positions ``>= 0`` in strictly increasing order (SPEC 5.2)."""
    if not rows.size:
        return
    bad = rows[:, 0] < 0
    if rows.shape[1] > 1:
        bad |= np.any(rows[:, 1:] <= rows[:, :-1], axis=1)
    if bad.any():
        raise CorruptFileError(
            f"{label}: selection row {int(np.argmax(bad))} is not key positions >= 0 in increasing order"
        )


def read_selection(
    file: FileStructure, chunks: np.ndarray, layer: int, seq: int, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, positions)`` of one layer's key selections from the snapshot's checked
    ``chunks``, positions ``start <= p < stop``; ``rows`` ``(n, width)`` int32, each checked."""
    spec = file.manifest.layers[layer].queries
    assert spec is not None and spec.selection is not None
    table = file.table[chunks]
    mine = chunks[(table["layer"] == layer) & (table["seq"] == seq) & (table["kind"] == KIND_SELECTION)]
    return _rows_between(file, mine, start, stop, np.empty((0, spec.selection), np.int32), selections=True)
