"""Snapshots of a series as deltas: each snapshot names its parent, the positions it drops from
the parent's state and the chunk rows it appends. Replaying the chain gives every head's runs.

A run is ``(chunk, row, count, position)``: rows ``[row, row + count)`` of table chunk
``chunk``, holding absolute positions ``[position, position + count)``. Storing deltas keeps the
index of an n-snapshot series O(n), where full segment lists would grow O(n^2).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvformat.errors import CorruptFileError
from kvformat.layout import DESCRIPTOR_SIZE, KIND_K, KIND_V, MAX_POSITION
from kvformat.runs import (
    CHUNK,
    COUNT,
    HEAD,
    KIND,
    LAYER,
    POSITION,
    ROW,
    SEQ,
    Segments,
    check_runs,
    head_keys,
    ranges,
    trim_runs,
)

Run = tuple[int, int, int, int]
Key = tuple[int, int, int, int]  # (layer, seq, head, kind)


def trim(runs: list[Run], start: int, stop: int) -> list[Run]:
    """Remove positions ``[start, stop)`` from ``runs``, splitting a run that straddles them."""
    kept: list[Run] = []
    for chunk, row, count, position in runs:
        end = position + count
        before = end <= start if count else position < start  # an empty run at start goes too
        if before or position >= stop:
            kept.append((chunk, row, count, position))
            continue
        if position < start:
            kept.append((chunk, row, start - position, position))
        if end > stop:
            kept.append((chunk, row + stop - position, end - stop, stop))
    return kept


# The 1.2 feature a file lists in ``required_features`` when a snapshot uses ``append_chunks``.
APPEND_CHUNKS = "append-chunks"


def _no_ranges() -> np.ndarray:
    return np.empty((0, 2), np.int64)


@dataclass
class Entry:
    """One snapshot as stored: parent index (or None), drops, appended (chunk, row, count)
    triples, and appended whole-chunk ranges ``[first, stop)`` (``append_chunks``, format 1.2)."""

    parent: int | None
    drops: list[tuple[int, int, int, int]]
    appends: list[tuple[int, int, int]] | np.ndarray  # (chunk, row, count) triples, or (n, 3) int64
    metadata: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, int] = field(default_factory=dict)
    chunk_ranges: np.ndarray = field(default_factory=_no_ranges)  # (m, 2) int64: first, stop
    query_ranges: np.ndarray = field(default_factory=_no_ranges)  # (m, 2): Q chunks added (1.3)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "parent": self.parent,
            "drop": [list(d) for d in self.drops],
            "append": (
                self.appends.reshape(-1).tolist()
                if isinstance(self.appends, np.ndarray)
                else list(itertools.chain.from_iterable(self.appends))
            ),
            "metadata": self.metadata,
        }
        if self.chunk_ranges.size:
            document["append_chunks"] = self.chunk_ranges.reshape(-1).tolist()
        if self.arrays:
            document["arrays"] = self.arrays
        if self.query_ranges.size:
            document["queries"] = self.query_ranges.reshape(-1).tolist()
        return document


def chunk_ranges(chunks: np.ndarray) -> np.ndarray:
    """Sorted distinct chunk indices as maximal ``[first, stop)`` ranges, ``(m, 2)`` int64."""
    if not chunks.size:
        return _no_ranges()
    breaks = np.flatnonzero(np.diff(chunks) != 1) + 1
    firsts = chunks[np.concatenate(([0], breaks))]
    stops = chunks[np.concatenate((breaks - 1, [chunks.size - 1]))] + 1
    return np.stack([firsts, stops], axis=1).astype(np.int64)


def _ints(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise CorruptFileError(f"{where} must be a list of integers")
    if value and (min(value) < 0 or max(value) > MAX_POSITION):
        raise CorruptFileError(f"{where} holds an integer outside 0..2**53")
    return value


def _int_array(value: Any, where: str) -> np.ndarray:
    """`_ints` for long lists, as an int64 array: the type test runs in C (``map``/``set``), not
    per element in Python (a series' index holds a triple per chunk)."""
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise CorruptFileError(f"{where} must be a list of integers")
    try:
        array = np.array(value, dtype=np.int64)
    except OverflowError:
        raise CorruptFileError(f"{where} holds an integer outside 0..2**53") from None
    if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_POSITION):
        raise CorruptFileError(f"{where} holds an integer outside 0..2**53")
    return array


def parse_entry(obj: Any, index: int, num_layers: int, num_seqs: int) -> Entry:
    """Validate one snapshot object of the index JSON (types and ranges, not chunk refs)."""
    where = f"snapshot {index}"
    if not isinstance(obj, dict):
        raise CorruptFileError(f"{where} must be a JSON object")
    parent = obj.get("parent")
    if parent is not None and (type(parent) is not int or not 0 <= parent < index):
        raise CorruptFileError(f"{where}: parent must be null or an earlier snapshot, got {parent!r}")
    drops = _drops(obj.get("drop", []), where, num_layers, num_seqs)
    appends = _int_array(obj.get("append", []), f"{where} append")
    if appends.size % 3:
        raise CorruptFileError(f"{where}: 'append' must hold (chunk, row, count) triples")
    metadata, arrays = _entry_objects(obj, where)
    ranges = _chunk_ranges(obj.get("append_chunks", []), where, "append_chunks")
    queries = _chunk_ranges(obj.get("queries", []), where, "queries")
    return Entry(parent, drops, appends.reshape(-1, 3), metadata, arrays, ranges, queries)


def _entry_objects(obj: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, int]]:
    """A snapshot's ``metadata`` (an object) and ``arrays`` (names to chunk indices)."""
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CorruptFileError(f"{where}: metadata must be an object")
    arrays = obj.get("arrays", {})
    if not isinstance(arrays, dict) or not all(type(v) is int and v >= 0 for v in arrays.values()):
        raise CorruptFileError(f"{where}: 'arrays' must map names to chunk indices")
    return metadata, arrays


def _drops(value: Any, where: str, num_layers: int, num_seqs: int) -> list[tuple[int, int, int, int]]:
    """A snapshot's ``drop`` list: ``[layer, seq, start, stop]`` items naming a layer, a sequence
    and a range ``start <= stop``."""
    if not isinstance(value, list):
        raise CorruptFileError(f"{where}: 'drop' must be a list")
    drops = []
    for item in value:
        values = _ints(item, f"{where} drop")
        if len(values) != 4:
            raise CorruptFileError(f"{where}: a drop is [layer, seq, start, stop]")
        layer, seq, start, stop = values
        if layer >= num_layers or seq >= num_seqs or start > stop:
            raise CorruptFileError(f"{where}: drop {values} names no valid layer, sequence or range")
        drops.append((layer, seq, start, stop))
    return drops


def _chunk_ranges(value: Any, where: str, key: str) -> np.ndarray:
    """A snapshot's list of ``(first, stop)`` chunk ranges under ``key`` (``append_chunks``,
    ``queries``) as an ``(n, 2)`` int64 array; each range non-empty."""
    ranges = _int_array(value, f"{where} {key}")
    if ranges.size % 2:
        raise CorruptFileError(f"{where}: '{key}' must hold (first, stop) pairs")
    ranges = ranges.reshape(-1, 2)
    if bool(np.any(ranges[:, 0] >= ranges[:, 1])):
        article = "an" if key[0] in "aeiou" else "a"
        raise CorruptFileError(f"{where}: {article} '{key}' range is empty (first >= stop)")
    return ranges


class Chain:
    """Materializes snapshots of one file with numpy: each snapshot's runs are its parent's, less
    its drops, plus its appends. Remembers the last state, so walking a series in order costs
    each entry once."""

    def __init__(self, entries: list[Entry], table: np.ndarray) -> None:
        self.entries = entries
        self._table = table
        self._n = len(table)
        self._cache: tuple[int, list[np.ndarray]] | None = None

    _FIELDS = ("layer", "seq", "head", "kind", "rows", "position")

    def _stack(self, chunks: np.ndarray | None = None) -> np.ndarray:
        """``(6, n)`` int64: layer, seq, head, kind, rows, position of the descriptors of
        ``chunks`` (all if None), one contiguous row per field (only those six are read)."""
        index: np.ndarray | slice = slice(None) if chunks is None else chunks
        if chunks is not None and chunks.shape[0] and bool(np.all(np.diff(chunks) == 1)):
            index = slice(int(chunks[0]), int(chunks[-1]) + 1)  # a range: slices, not a gather
        out = np.empty((6, self._table["kind"][index].shape[0]), np.int64)
        for column, name in enumerate(self._FIELDS):
            out[column] = self._table[name][index]
        return out

    @functools.cached_property
    def _columns(self) -> np.ndarray:
        """Columns of every chunk (made only when every chunk is needed: `check_all`)."""
        return self._stack()

    def _columns_of(self, chunks: np.ndarray) -> np.ndarray:
        if "_columns" in self.__dict__:
            return self._columns[:, chunks]
        return self._stack(chunks)

    def appended(self, index: int) -> np.ndarray:
        """The validated runs snapshot ``index`` appends, ``(n, 8)``: its triples, then every row
        of each chunk of its ``append_chunks`` ranges."""
        found = self._appends(index, index + 1, strict=True)
        assert found is not None  # strict: a bad reference raised
        return found[0].T

    def _apply(self, state: list[np.ndarray], index: int) -> list[np.ndarray]:
        entry = self.entries[index]
        if entry.drops:
            runs = np.concatenate(state) if state else np.empty((0, 8), np.int64)
            for layer, seq, start, stop in entry.drops:
                runs = trim_runs(runs, start, stop, layer, seq)
            state = [runs]
        return [*state, self.appended(index)]

    def runs(self, index: int) -> np.ndarray:
        """Every live run of snapshot ``index``, ``(n, 8)`` (not yet checked as a whole)."""
        chain: list[int] = []
        cursor: int | None = index
        state: list[np.ndarray] = []
        while cursor is not None:
            if self._cache is not None and self._cache[0] == cursor:
                state = list(self._cache[1])
                break
            chain.append(cursor)
            cursor = self.entries[cursor].parent
        for i in reversed(chain):
            state = self._apply(state, i)
        joined = np.concatenate(state) if state else np.empty((0, 8), np.int64)
        self._cache = (index, [joined])
        return joined

    def state(self, index: int) -> dict[Key, list[Run]]:
        """Runs per (layer, seq, head, kind) of snapshot ``index`` as ``(chunk, row, count,
        position)`` tuples (not yet validated)."""
        out: dict[Key, list[Run]] = {}
        for r in self.runs(index).tolist():
            out.setdefault((r[LAYER], r[SEQ], r[HEAD], r[KIND]), []).append(
                (r[CHUNK], r[ROW], r[COUNT], r[POSITION])
            )
        return out

    def segments(self, index: int) -> Segments:
        """Validated K/V segment pairs of snapshot ``index``."""
        return check_runs(self.runs(index), index)

    def check_all(self) -> None:
        """Check every snapshot, each entry once. Stretches of snapshots that only append to the
        one before are checked together (`_appends_hold`); a file where that does not settle
        it (or that is corrupt) is checked snapshot by snapshot (`_check_each`), which also
        names the first problem."""
        starts = [i for i, e in enumerate(self.entries) if i == 0 or e.parent != i - 1 or e.drops]
        stops = [*starts[1:], len(self.entries)]
        for first, stop in zip(starts, stops, strict=True):
            base = self.runs(first)
            check_runs(base, first)
            if stop - first > 1:
                if self._regular_appends_hold(base, first, stop):
                    continue
                new = self._appends(first + 1, stop, strict=False)
                if new is None or not _appends_hold(base, *new, first):
                    self._check_each()
                    return
                self._cache = (stop - 1, [base, new[0].T])

    _REGULAR_BLOCK_CHUNKS = 1 << 15  # chunks compared at a time: small temporaries, reused

    def _regular_appends_hold(self, base: np.ndarray, first: int, stop: int) -> bool:
        """Whether snapshots ``first + 1 .. stop - 1`` are valid, shown without materializing
        their runs, for the shape a series writer gives: each snapshot appends one whole-chunk
        range right after the one before, every range of the same layout (the same (layer,
        seq, head, kind) in the same order, each once, K and V in pairs). Then snapshot by
        snapshot is column by column of a ``(snapshots, chunks per snapshot)`` view of the chunk
        table: K and V at equal positions and rows, each run at or after the end of its head's
        run one snapshot before (the first after ``base``, the validated runs of ``first``).
        False means "not shown" (another shape, or a problem): `_appends_hold` decides."""
        span = _regular_span(self.entries[first + 1 : stop])
        if span is None or span[0] + span[2] * span[1] > self._n:
            return False
        start, width, count = span
        table = self._table[start : start + count * width]
        if not table.flags.c_contiguous:  # viewed as 8-byte words below
            return False
        layout = table[:width]
        keys = list(zip(*(layout[f].tolist() for f in ("layer", "seq", "head", "kind")), strict=True))
        pairs = _kv_pairs(keys)
        if pairs is None:
            return False
        k_index, v_index = pairs
        column = {key: j for j, key in enumerate(keys)}
        ends = np.full(width, np.iinfo(np.int64).min)  # per column: end of what the head holds
        held = base[:, POSITION] + base[:, COUNT]
        for run, end in zip(base[:, [LAYER, SEQ, HEAD, KIND]].tolist(), held.tolist(), strict=True):
            j = column.get(tuple(run), -1)
            if j >= 0:
                ends[j] = max(ends[j], end)
        # (layer, head, seq) are descriptor bytes 8..15: one 8-byte word compared for the three.
        places = table.view(np.uint64).reshape(-1, DESCRIPTOR_SIZE // 8)[:, 1]
        per_block = max(1, self._REGULAR_BLOCK_CHUNKS // width)
        for block in range(0, count, per_block):
            lo, hi = block * width, min(count, block + per_block) * width
            rows = table[lo:hi].reshape(-1, width)
            if not (
                bool((places[lo:hi].reshape(-1, width) == places[:width]).all())
                and bool((rows["kind"] == layout["kind"]).all())
            ):
                return False
            following = _runs_follow(rows["position"], rows["rows"], ends, k_index, v_index)
            if following is None:
                return False
            ends = following
        return True

    def _appends(self, first: int, stop: int, strict: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """What snapshots ``first .. stop-1`` append, at once: their runs transposed, ``(8, n)``
        (one contiguous row per column; per snapshot its triples, then every row of each chunk of
        its ``append_chunks`` ranges), and each run's snapshot ``(n,)``. A reference out of
        bounds raises `CorruptFileError` naming it (``strict``) or gives None."""

        def bad(message: str) -> None:
            if strict:
                raise CorruptFileError(message)

        n = self._n
        entries = self.entries[first:stop]
        triples = [np.asarray(e.appends, dtype=np.int64).reshape(-1, 3) for e in entries]
        spans = [e.chunk_ranges for e in entries]
        triple, span = np.concatenate(triples), np.concatenate(spans)
        numbers = np.arange(first, stop, dtype=np.int64)
        span_snapshot = np.repeat(numbers, [r.shape[0] for r in spans])
        if span.shape[0] and int(span[:, 1].max()) > n:  # before making a range that long
            i = int(np.argmax(span[:, 1] > n))
            bad(f"snapshot {int(span_snapshot[i])} appends chunk {int(span[i, 1]) - 1}; the file has {n}")
            return None
        whole_counts = span[:, 1] - span[:, 0]
        whole = ranges(span[:, 0], whole_counts)
        snapshot = np.concatenate(
            [np.repeat(numbers, [t.shape[0] for t in triples]), np.repeat(span_snapshot, whole_counts)]
        )
        chunk = np.concatenate([triple[:, 0], whole])
        if chunk.shape[0] and int(chunk.max()) >= n:
            i = int(np.argmax(chunk >= n))
            bad(f"snapshot {int(snapshot[i])} appends chunk {int(chunk[i])}; the file has {n}")
            return None
        columns = self._columns_of(chunk)
        kind, rows = columns[3], columns[4]
        tensor = (kind == KIND_K) | (kind == KIND_V)
        if not tensor.all():
            i = int(np.argmin(tensor))
            bad(f"snapshot {int(snapshot[i])} appends chunk {int(chunk[i])}, which is not K or V")
            return None
        row = np.concatenate([triple[:, 1], np.zeros(whole.shape[0], np.int64)])
        count = np.concatenate([triple[:, 2], rows[triple.shape[0] :]])
        # A triple names at least one row; a whole chunk of 0 rows is an empty run (SPEC 11).
        outside = (row + count > rows) | (count < 0)
        outside[: triple.shape[0]] |= count[: triple.shape[0]] < 1
        if outside.any():
            i = int(np.argmax(outside))
            bad(
                f"snapshot {int(snapshot[i])}: rows {int(row[i])}+{int(count[i])} "
                f"fall outside chunk {int(chunk[i])}"
            )
            return None
        runs = np.empty((8, chunk.shape[0]), np.int64)  # column by column: a run per column
        runs[:4] = columns[:4]
        runs[CHUNK], runs[ROW], runs[COUNT] = chunk, row, count
        np.add(columns[5], row, out=runs[POSITION])
        if stop - first > 1 and triple.shape[0] and whole.shape[0]:  # snapshot by snapshot
            order = np.argsort(snapshot, kind="stable")
            runs, snapshot = runs[:, order], snapshot[order]
        return runs, snapshot

    def _check_each(self) -> None:
        """`check_all` snapshot by snapshot: a snapshot whose parent is the one before is checked
        from what it adds (its K and V runs pair up, and none starts before the end of what its
        head holds; if one does, that snapshot is checked whole); any other snapshot is
        materialized and checked whole."""
        dense = _DenseKeys(self._columns)
        live: list[np.ndarray] | None = None  # runs of the previous snapshot, in blocks
        ends = dense.zeros()  # per (layer, seq, head, kind): one past the last position held
        for index, entry in enumerate(self.entries):
            if live is None or entry.parent != index - 1 or entry.drops:
                runs = self.runs(index)
                check_runs(runs, index)
                live, ends = [runs], dense.zeros()
                np.maximum.at(ends, dense.of(runs), runs[:, POSITION] + runs[:, COUNT])
                continue
            new = self.appended(index)
            check_runs(new, index)  # K and V of what is added pair up, no position twice within
            ids = dense.of(new)
            live.append(new)
            if bool(np.any(new[:, POSITION] < ends[ids])):
                check_runs(np.concatenate(live), index)  # before a head's end: check it whole
            np.maximum.at(ends, ids, new[:, POSITION] + new[:, COUNT])
            self._cache = (index, list(live))


def _appends_hold(base: np.ndarray, new: np.ndarray, snapshot: np.ndarray, first: int) -> bool:
    """Whether the snapshots of a stretch are valid, given its first snapshot's (``first``)
    validated runs ``base`` ``(m, 8)`` and the runs appended after it, transposed, ``new``
    ``(8, n)`` (snapshot ``snapshot`` each, ascending): per head and kind, taken in snapshot
    order, every run starts at or after the end of the one before (no position twice, nothing
    before what the head holds), and K and V runs match per snapshot. One stable sort, column by
    column. False means "not shown": check snapshot by snapshot."""
    if not snapshot.size:  # nothing appended: every snapshot holds what the first one holds
        return True
    base = base[np.lexsort((base[:, POSITION], head_keys(base), base[:, KIND]))]
    runs = np.concatenate([base.T, new], axis=1)  # (8, m + n)
    step = np.concatenate([np.zeros(base.shape[0], np.int64), snapshot - first])
    steps = int(step[-1]) + 1
    is_k = runs[KIND] == KIND_K
    is_v = ~is_k
    columns = [LAYER, SEQ, HEAD, POSITION, COUNT]
    # K and V pair up per snapshot: compared in file order first (a writer puts them in the same
    # order), in sorted order only if that fails.
    if int(np.count_nonzero(is_k)) * 2 != runs.shape[1]:
        return False
    paired = np.array_equal(step[is_k], step[is_v]) and all(
        np.array_equal(runs[c][is_k], runs[c][is_v]) for c in columns
    )
    group = _dense_groups(runs, is_v, steps)
    order = np.argsort(group * steps + step, kind="stable")  # file order within a step
    group, position, count = group[order], runs[POSITION][order], runs[COUNT][order]
    if bool(np.any((group[1:] == group[:-1]) & (position[1:] < (position + count)[:-1]))):
        return False
    return paired or _paired_when_sorted(group, position, count, step[order])


def _dense_groups(runs: np.ndarray, is_v: np.ndarray, steps: int) -> np.ndarray:
    """A dense number per (layer, seq, head, kind) of runs ``(8, n)``, V odd, by arithmetic
    where it fits in int64 with ``steps`` snapshots (no sort needed), else by `np.unique`."""
    spans = [int(runs[c].max()) + 1 for c in (LAYER, SEQ, HEAD)]
    if spans[0] * spans[1] * spans[2] * 2 * steps < 1 << 62:
        group = (runs[LAYER] * spans[1] + runs[SEQ]) * spans[2] + runs[HEAD]
    else:
        group = np.unique(head_keys(runs.T), return_inverse=True)[1].reshape(-1)
    group *= 2
    group += is_v
    return group


def _paired_when_sorted(group: np.ndarray, position: np.ndarray, count: np.ndarray, step: np.ndarray) -> bool:
    """Runs sorted by (group, step): each K run has a V run of its head at the same position,
    count and snapshot."""
    is_k = (group & 1) == 0
    is_v = ~is_k
    return bool(
        np.array_equal(group[is_k] + 1, group[is_v])
        and np.array_equal(position[is_k], position[is_v])
        and np.array_equal(count[is_k], count[is_v])
        and np.array_equal(step[is_k], step[is_v])
    )


class _DenseKeys:
    """Numbers the (layer, seq, head, kind) of every chunk 0..size-1 (size <= chunks: bounded by
    the file, whatever its layer, sequence and head counts)."""

    def __init__(self, columns: np.ndarray) -> None:
        keys = (((columns[0] << 20) | columns[1]) << 17) | (columns[2] << 1) | (columns[3] & 1)
        unique, self._ids = np.unique(keys, return_inverse=True)
        self.size = max(int(unique.size), 1)

    def zeros(self) -> np.ndarray:
        return np.zeros(self.size, np.int64)

    def of(self, runs: np.ndarray) -> np.ndarray:
        return self._ids[runs[:, CHUNK]]


def _regular_span(entries: list[Entry]) -> tuple[int, int, int] | None:
    """``(start, width, count)`` when ``entries`` each append exactly one chunk range of ``width``
    chunks, right after the one before, from chunk ``start``; None for any other shape."""
    if any(len(e.appends) or e.chunk_ranges.shape[0] != 1 for e in entries):
        return None
    spans = np.concatenate([e.chunk_ranges for e in entries])
    width = int(spans[0, 1] - spans[0, 0])
    if not (bool(np.all(spans[:, 1] - spans[:, 0] == width)) and np.array_equal(spans[1:, 0], spans[:-1, 1])):
        return None
    return int(spans[0, 0]), width, spans.shape[0]


def _kv_pairs(keys: list[tuple[int, ...]]) -> tuple[slice | np.ndarray, slice | np.ndarray] | None:
    """The K columns and their V columns of a snapshot's chunk layout (``(layer, seq, head,
    kind)`` per column): slices when K and V alternate (a writer's order), index arrays otherwise;
    None unless every column is a K or V, each once, in pairs."""
    width = len(keys)
    column = {key: j for j, key in enumerate(keys)}
    if len(column) != width:  # a head and kind twice in one snapshot
        return None
    k_columns = [j for j, key in enumerate(keys) if key[3] == KIND_K]
    v_columns = [column.get((*key[:3], KIND_V), -1) for key in keys if key[3] == KIND_K]
    if len(k_columns) * 2 != width or min(v_columns) < 0:  # only K and V, in pairs
        return None
    if k_columns == list(range(0, width, 2)) and v_columns == list(range(1, width, 2)):
        return slice(0, None, 2), slice(1, None, 2)  # compared through slices, not gathers
    return np.array(k_columns), np.array(v_columns)


def _runs_follow(
    position: np.ndarray,
    size: np.ndarray,
    ends: np.ndarray,
    k_index: slice | np.ndarray,
    v_index: slice | np.ndarray,
) -> np.ndarray | None:
    """For a block of snapshots ``(snapshots, columns)`` of run positions and sizes: every run
    non-empty, K and V at equal positions and sizes, each at or after the end of its column's run
    one snapshot before (``ends`` for the first). The ends after the block, or None."""
    if int(size.min()) < 1 or not (
        bool((position[:, k_index] == position[:, v_index]).all())
        and bool((size[:, k_index] == size[:, v_index]).all())
    ):
        return None
    stops = position + size
    if not (bool((position[0] >= ends).all()) and bool((position[1:] >= stops[:-1]).all())):
        return None
    return stops[-1]
