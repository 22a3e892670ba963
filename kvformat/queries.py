"""Queries (format 1.3, SPEC sections 10.1 and 11.1): Q chunks, which snapshot holds which, and
one query head's rows read back.

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
from kvformat.layout import KIND_Q
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
    """Snapshot ``index``'s Q chunks, checked (SPEC R13 for ``queries``): inside the table, of
    kind Q, no (layer, seq, head) position twice. Returns the chunk indices sorted by (layer,
    seq, head, position)."""
    chunks = query_chunks(file.entries, index)
    if not chunks.size:
        return chunks
    n = len(file.table)
    if int(chunks.max()) >= n:
        raise CorruptFileError(
            f"snapshot {index}: 'queries' names chunk {int(chunks.max())}; the file has {n}"
        )
    table = file.table[chunks]
    if not bool(np.all(table["kind"] == KIND_Q)):
        bad = int(chunks[int(np.argmax(table["kind"] != KIND_Q))])
        raise CorruptFileError(f"snapshot {index}: 'queries' names chunk {bad}, which is not a Q chunk")
    layer, seq, head = (table[f].astype(np.int64) for f in ("layer", "seq", "head"))
    position, rows = table["position"].astype(np.int64), table["rows"].astype(np.int64)
    order = np.lexsort((position, head, seq, layer))
    chunks, layer, seq, head, position, rows = (a[order] for a in (chunks, layer, seq, head, position, rows))
    held = rows > 0  # a Q chunk of 0 rows holds no position: it can hold none twice (SPEC 11.1)
    layer, seq, head, position, rows = (a[held] for a in (layer, seq, head, position, rows))
    same = (layer[1:] == layer[:-1]) & (seq[1:] == seq[:-1]) & (head[1:] == head[:-1])
    twice = same & (position[1:] < position[:-1] + rows[:-1])
    if twice.any():
        i = int(np.argmax(twice)) + 1
        raise CorruptFileError(
            f"snapshot {index}: layer {int(layer[i])} query head {int(head[i])} seq {int(seq[i])} "
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
    mine = chunks[(table["layer"] == layer) & (table["seq"] == seq) & (table["head"] == head)]
    parts: list[np.ndarray] = []
    places: list[np.ndarray] = []
    for chunk in mine.tolist():
        info = file.table[chunk]
        first, count = int(info["position"]), int(info["rows"])
        low, high = max(start, first), min(stop, first + count)
        if low >= high:
            continue
        parts.append(file.chunk_array(chunk)[low - first : high - first])
        places.append(np.arange(low, high, dtype=np.int64))
    if not parts:
        return np.empty((0, spec.dim), spec.dtype.numpy), np.empty(0, np.int64)
    if len(parts) == 1:
        return parts[0], places[0]
    return np.concatenate(parts), np.concatenate(places)
