"""Runs of rows as arrays: what a snapshot's replayed chain resolves to, and how readers find a
head's rows.

A runs array is ``(n, 8)`` int64, one row per run of rows of one K or V chunk, columns `LAYER`,
`SEQ`, `HEAD`, `KIND`, `CHUNK`, `ROW`, `COUNT`, `POSITION`: rows ``[row, row + count)`` of chunk
``chunk`` hold absolute positions ``[position, position + count)``. `Segments` pairs the K and V
runs of a validated snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvformat.errors import CorruptFileError
from kvformat.layout import KIND_K, KIND_V


@dataclass(frozen=True)
class Segment:
    """A run of contiguous positions of one head: rows of one K chunk and one V chunk."""

    layer: int
    head: int
    seq: int
    k_chunk: int
    k_row: int
    v_chunk: int
    v_row: int
    count: int
    position: int


# Columns of a runs array ``(n, 8)`` int64: one row per run of rows of one K or V chunk.
LAYER, SEQ, HEAD, KIND, CHUNK, ROW, COUNT, POSITION = range(8)


def trim_runs(
    runs: np.ndarray, start: int, stop: int, layer: int | None = None, seq: int | None = None
) -> np.ndarray:
    """``runs`` with positions ``[start, stop)`` removed (of ``layer``/``seq`` only, if given): a
    run straddling the range keeps its pieces, in place and in order (as `trim`)."""
    position, count = runs[:, POSITION], runs[:, COUNT]
    end = position + count
    # A run loses the positions it has in [start, stop); an empty run at p goes when start <= p
    hit = ((end > start) | ((count == 0) & (position >= start))) & (position < stop)
    if layer is not None:
        hit &= (runs[:, LAYER] == layer) & (runs[:, SEQ] == seq)
    if not hit.any():
        return runs
    left = hit & (position < start)
    right = hit & (end > stop)
    copies = np.where(hit, left.astype(np.int64) + right, 1)
    out = np.repeat(runs, copies, axis=0)
    first = np.cumsum(copies) - copies  # where each input row's first copy lands
    at = first[left]
    out[at, COUNT] = start - position[left]
    at = first[right] + left[right]
    out[at, ROW] += stop - position[right]
    out[at, COUNT] = end[right] - stop
    out[at, POSITION] = stop
    return out


def head_keys(runs: np.ndarray) -> np.ndarray:
    """One int64 per run naming its (layer, seq, head): layer < 2^16, seq < 2^20, head < 2^16."""
    return (runs[:, LAYER] << 36) | (runs[:, SEQ] << 16) | runs[:, HEAD]


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` as int64, in bulk."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.empty(0, np.int64)
    # Each element is its run's start plus its index within the run.
    run_of = np.repeat(np.arange(counts.size), counts)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.asarray(starts, np.int64)[run_of] + offsets


class Segments:
    """The validated K/V run pairs of one snapshot as arrays, sorted by (layer, seq, head,
    position); `Segment` objects are made only for what is asked."""

    def __init__(self, k: np.ndarray, v: np.ndarray) -> None:
        self._k, self._v = k, v  # matching rows: K runs and V runs
        self._keys = head_keys(k)

    def __len__(self) -> int:
        return int(self._k.shape[0])

    def _build(self, rows: np.ndarray) -> list[Segment]:
        k, v = self._k[rows].tolist(), self._v[rows].tolist()
        return [
            Segment(a[LAYER], a[HEAD], a[SEQ], a[CHUNK], a[ROW], b[CHUNK], b[ROW], a[COUNT], a[POSITION])
            for a, b in zip(k, v, strict=True)
        ]

    def _head_rows(self, layer: int, seq: int, head: int) -> np.ndarray:
        key = (layer << 36) | (seq << 16) | head
        first, last = np.searchsorted(self._keys, [key, key + 1])
        return np.arange(first, last)

    def of_head(self, layer: int, seq: int, head: int) -> list[Segment]:
        """One head's segments in position order."""
        return self._build(self._head_rows(layer, seq, head))

    def positions_of_head(self, layer: int, seq: int, head: int) -> np.ndarray:
        """The absolute positions ``(n_tokens,)`` int64 one head holds, in order, from its runs
        in bulk (no `Segment` per run: a head of a long series has one run per snapshot)."""
        runs = self._k[self._head_rows(layer, seq, head)]
        return ranges(runs[:, POSITION], runs[:, COUNT])

    def in_file_order(self) -> list[Segment]:
        """Every segment, in file order of its K chunk."""
        return self._build(np.argsort(self._k[:, CHUNK], kind="stable"))

    def head_ends(self) -> dict[tuple[int, int, int], int]:
        """One past the largest position each (layer, seq, head) holding rows holds."""
        if not len(self):
            return {}
        ends = self._k[:, POSITION] + self._k[:, COUNT]
        keys, first = np.unique(self._keys, return_index=True)
        largest = np.maximum.reduceat(ends, first)
        return {
            (int(key) >> 36, (int(key) >> 16) & 0xFFFFF, int(key) & 0xFFFF): int(end)
            for key, end in zip(keys.tolist(), largest.tolist(), strict=True)
        }

    def end(self) -> int:
        """One past the largest position held (0 if none)."""
        if not len(self):
            return 0
        return int((self._k[:, POSITION] + self._k[:, COUNT]).max())


def check_runs(runs: np.ndarray, index: int) -> Segments:
    """Section 11's rules for a materialized snapshot: per head, K runs and V runs cover the same
    (position, count) list, and no position appears twice. Returns the pairs as `Segments`."""
    k = runs[runs[:, KIND] == KIND_K]
    v = runs[runs[:, KIND] == KIND_V]
    # Per head, by position, then count: an empty run sorts before a run starting where it is
    k = k[np.lexsort((k[:, COUNT], k[:, POSITION], head_keys(k)))]
    v = v[np.lexsort((v[:, COUNT], v[:, POSITION], head_keys(v)))]
    same = k.shape == v.shape
    if same:
        columns = [LAYER, SEQ, HEAD, POSITION, COUNT]
        differ = np.any(k[:, columns] != v[:, columns], axis=1)
        same = not differ.any()
    if not same:
        first = _first_mismatch(k, v)
        raise CorruptFileError(
            f"snapshot {index}: K and V of layer {first[0]} head {first[2]} seq {first[1]} "
            "do not cover the same positions"
        )
    if k.shape[0] > 1:
        keys = head_keys(k)
        twice = (keys[1:] == keys[:-1]) & (k[1:, POSITION] < k[:-1, POSITION] + k[:-1, COUNT])
        if twice.any():
            i = int(np.argmax(twice)) + 1
            raise CorruptFileError(
                f"snapshot {index}: layer {int(k[i, LAYER])} head {int(k[i, HEAD])} seq {int(k[i, SEQ])} "
                f"holds position {int(k[i, POSITION])} twice"
            )
    return Segments(k, v)


def _first_mismatch(k: np.ndarray, v: np.ndarray) -> tuple[int, int, int]:
    """(layer, seq, head) of the first head whose K and V runs differ."""
    n = min(k.shape[0], v.shape[0])
    columns = [LAYER, SEQ, HEAD, POSITION, COUNT]
    differ = np.flatnonzero(np.any(k[:n][:, columns] != v[:n][:, columns], axis=1))
    row = k[differ[0]] if differ.size else (k[n] if k.shape[0] > n else v[n])
    return int(row[LAYER]), int(row[SEQ]), int(row[HEAD])
