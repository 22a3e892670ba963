"""Snapshots of a series as deltas: each snapshot names its parent, the positions it drops from
the parent's state and the chunk rows it appends. Replaying the chain gives every head's runs.

A run is ``(chunk, row, count, position)``: rows ``[row, row + count)`` of table chunk
``chunk``, holding absolute positions ``[position, position + count)``. Storing deltas keeps the
index of an n-snapshot series O(n), where full segment lists would grow O(n^2).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvformat.errors import CorruptFileError
from kvformat.layout import KIND_K, KIND_V, MAX_POSITION

Run = tuple[int, int, int, int]
Key = tuple[int, int, int, int]  # (layer, seq, head, kind)


def trim(runs: list[Run], start: int, stop: int) -> list[Run]:
    """Remove positions ``[start, stop)`` from ``runs``, splitting a run that straddles them."""
    kept: list[Run] = []
    for chunk, row, count, position in runs:
        end = position + count
        if end <= start or position >= stop:
            kept.append((chunk, row, count, position))
            continue
        if position < start:
            kept.append((chunk, row, start - position, position))
        if end > stop:
            kept.append((chunk, row + stop - position, end - stop, stop))
    return kept


@dataclass
class Entry:
    """One snapshot as stored: parent index (or None), drops, appended (chunk, row, count)."""

    parent: int | None
    drops: list[tuple[int, int, int, int]]
    appends: list[tuple[int, int, int]]
    metadata: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "parent": self.parent,
            "drop": [list(d) for d in self.drops],
            "append": list(itertools.chain.from_iterable(self.appends)),
            "metadata": self.metadata,
        }
        if self.arrays:
            document["arrays"] = self.arrays
        return document


def _ints(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise CorruptFileError(f"{where} must be a list of integers")
    if value and (min(value) < 0 or max(value) > MAX_POSITION):
        raise CorruptFileError(f"{where} holds an integer outside 0..2**53")
    return value


def parse_entry(obj: Any, index: int, num_layers: int, num_seqs: int) -> Entry:
    """Validate one snapshot object of the index JSON (types and ranges, not chunk refs)."""
    where = f"snapshot {index}"
    if not isinstance(obj, dict):
        raise CorruptFileError(f"{where} must be a JSON object")
    parent = obj.get("parent")
    if parent is not None and (type(parent) is not int or not 0 <= parent < index):
        raise CorruptFileError(f"{where}: parent must be null or an earlier snapshot, got {parent!r}")
    drop_json = obj.get("drop", [])
    if not isinstance(drop_json, list):
        raise CorruptFileError(f"{where}: 'drop' must be a list")
    drops = []
    for item in drop_json:
        values = _ints(item, f"{where} drop")
        if len(values) != 4:
            raise CorruptFileError(f"{where}: a drop is [layer, seq, start, stop]")
        layer, seq, start, stop = values
        if layer >= num_layers or seq >= num_seqs or start > stop:
            raise CorruptFileError(f"{where}: drop {values} names no valid layer, sequence or range")
        drops.append((layer, seq, start, stop))
    flat = _ints(obj.get("append", []), f"{where} append")
    if len(flat) % 3:
        raise CorruptFileError(f"{where}: 'append' must hold (chunk, row, count) triples")
    appends = list(zip(flat[0::3], flat[1::3], flat[2::3], strict=True))
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CorruptFileError(f"{where}: metadata must be an object")
    arrays = obj.get("arrays", {})
    if not isinstance(arrays, dict) or not all(type(v) is int and v >= 0 for v in arrays.values()):
        raise CorruptFileError(f"{where}: 'arrays' must map names to chunk indices")
    return Entry(parent, drops, appends, metadata, arrays)


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


class Chain:
    """Materializes snapshots of one file; remembers the last state to make walks cheap."""

    def __init__(self, entries: list[Entry], table: np.ndarray) -> None:
        self.entries = entries
        self._rows = table["rows"].tolist()
        self._position = table["position"].tolist()
        self._key = list(
            zip(
                table["layer"].tolist(),
                table["seq"].tolist(),
                table["head"].tolist(),
                table["kind"].tolist(),
                strict=True,
            )
        )
        self._cache: tuple[int, dict[Key, list[Run]]] | None = None

    def state(self, index: int) -> dict[Key, list[Run]]:
        """Runs per (layer, seq, head, kind) of snapshot ``index`` (not yet validated)."""
        chain: list[int] = []
        cursor: int | None = index
        base: dict[Key, list[Run]] = {}
        while cursor is not None:
            if self._cache is not None and self._cache[0] == cursor:
                base = {key: list(runs) for key, runs in self._cache[1].items()}
                break
            chain.append(cursor)
            cursor = self.entries[cursor].parent
        state = base
        for i in reversed(chain):
            self._apply(state, self.entries[i], i)
        self._cache = (index, state)
        return {key: list(runs) for key, runs in state.items()}

    def _apply(self, state: dict[Key, list[Run]], entry: Entry, index: int) -> None:
        for layer, seq, start, stop in entry.drops:
            for key in state:
                if key[0] == layer and key[1] == seq:
                    state[key] = trim(state[key], start, stop)
        n = len(self._rows)
        for chunk, row, count in entry.appends:
            if chunk >= n:
                raise CorruptFileError(f"snapshot {index} appends chunk {chunk}; the file has {n}")
            if self._key[chunk][3] not in (KIND_K, KIND_V):
                raise CorruptFileError(f"snapshot {index} appends chunk {chunk}, which is not K or V")
            if count < 1 or row + count > self._rows[chunk]:
                raise CorruptFileError(f"snapshot {index}: rows {row}+{count} fall outside chunk {chunk}")
            state.setdefault(self._key[chunk], []).append((chunk, row, count, self._position[chunk] + row))

    def segments(self, index: int) -> dict[tuple[int, int, int], list[Segment]]:
        """Validated K/V segment pairs per (layer, seq, head), in position order."""
        state = self.state(index)
        groups: dict[tuple[int, int, int], list[Segment]] = {}
        heads = {(key[0], key[1], key[2]) for key, runs in state.items() if runs}
        for layer, seq, head in heads:
            k_runs = sorted(state.get((layer, seq, head, KIND_K), []), key=lambda r: r[3])
            v_runs = sorted(state.get((layer, seq, head, KIND_V), []), key=lambda r: r[3])
            if [(r[3], r[2]) for r in k_runs] != [(r[3], r[2]) for r in v_runs]:
                raise CorruptFileError(
                    f"snapshot {index}: K and V of layer {layer} head {head} seq {seq} "
                    "do not cover the same positions"
                )
            for before, after in itertools.pairwise(k_runs):
                if after[3] < before[3] + before[2]:
                    raise CorruptFileError(
                        f"snapshot {index}: layer {layer} head {head} seq {seq} holds position "
                        f"{after[3]} twice"
                    )
            groups[(layer, seq, head)] = [
                Segment(layer, head, seq, k[0], k[1], v[0], v[1], k[2], k[3])
                for k, v in zip(k_runs, v_runs, strict=True)
            ]
        return groups
