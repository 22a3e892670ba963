"""Reading `.kv` files: `open` parses header, footer and index only (`kvformat.structure`);
`Snapshot` reads K/V per head; `Snapshot.verify` checks everything (`kvformat.verify`).

Raw chunks come back as zero-copy views of a memory map; compressed chunks are decoded on demand.
Every rule of ``spec/SPEC.md`` section 8 is checked before a size field is trusted.
"""

from __future__ import annotations

import collections
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import numpy as np

from kvformat import attention
from kvformat.attention import Attention
from kvformat.errors import (
    ConflictingArgumentsError,
    IncompleteSnapshotError,
    InvalidArgumentError,
    NoQueriesError,
    OutOfRangeError,
)
from kvformat.io import remote
from kvformat.io.remote import READ_AHEAD
from kvformat.io.source import open_source
from kvformat.layout import KIND_K, KIND_V, MAX_POSITION
from kvformat.manifest import LayerSpec
from kvformat.pages import Head, Pages
from kvformat.quantization import Parts
from kvformat.queries import (
    Queries,
    Selection,
    check_all_queries,
    check_queries,
    read_queries,
    read_selection,
)
from kvformat.runs import CHUNK, COUNT, HEAD, KIND, LAYER, POSITION, ROW, SEQ, Segment, Segments, ranges
from kvformat.structure import FileStructure, check_arrays
from kvformat.verify import VerifyReport, verify


def _chunks_of(segments: list[Any], values: bool) -> list[int]:
    """The K chunks of ``segments`` (and their V chunks with ``values``), in order."""
    if values:
        return [c for s in segments for c in (s.k_chunk, s.v_chunk)]
    return [s.k_chunk for s in segments]


def _joined(*parts: list[np.ndarray]) -> list[np.ndarray]:
    """Each list of parts as one array: the part itself where it is alone (a zero-copy view)."""
    return [found[0] if len(found) == 1 else np.concatenate(found) for found in parts]


def _former_tokens(positions: Any, tokens: Any) -> Any:
    """`Snapshot.head`'s ``tokens=`` (the former name of ``positions=``): its value, with a
    deprecation warning; both given is an error."""
    if positions is not None:
        raise ConflictingArgumentsError("give positions=, not both positions= and its former name tokens=")
    warnings.warn("head(tokens=...) is now head(positions=...)", DeprecationWarning, stacklevel=3)
    return tokens


class Snapshot:
    """One snapshot of a `.kv` file (the last one unless another is selected).

    Use as a context manager. ``head(layer, head)`` returns a `Head` or ``None`` for an absent
    layer; ``blocks()`` streams every segment in file order; ``verify()`` checks every byte.
    """

    def __init__(self, file: FileStructure, index: int) -> None:
        count = len(file.entries)
        if not isinstance(index, int) or not -count <= index < count:
            raise OutOfRangeError(
                f"snapshot {index} out of range: the file holds {count} "
                f"(numbered 0..{count - 1}; -1 is the last)"
            )
        self._file = file
        self.index = index % count
        entry = file.entries[self.index]
        self.snapshot_metadata: dict[str, Any] = entry.metadata
        self._arrays = entry.arrays  # checked when the snapshot is materialized (SPEC 13.1, step 9)

    @functools.cached_property
    def _segments(self) -> Segments:
        """This snapshot materialized and checked (SPEC R13-R14), on first use: opening a long
        series or selecting a snapshot builds nothing until data or structure is asked for."""
        check_arrays(self._file, self.index, self._arrays)
        return self._file.chain.segments(self.index)

    # -- structure -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._file.source.name

    @property
    def version(self) -> tuple[int, int]:
        """``(major, minor)`` format version of the file."""
        return self._file.version

    @property
    def metadata(self) -> dict[str, Any]:
        """File-level metadata (model, tokenizer, RoPE, ...); see `snapshot_metadata` too."""
        return self._file.manifest.metadata

    @property
    def layers(self) -> list[LayerSpec]:
        return self._file.manifest.layers

    @property
    def num_layers(self) -> int:
        return len(self._file.manifest.layers)

    @property
    def num_seqs(self) -> int:
        return self._file.manifest.num_seqs

    @property
    def num_snapshots(self) -> int:
        return len(self._file.entries)

    @property
    def parent(self) -> int | None:
        """Index of the snapshot this one was derived from (None for the first of a series)."""
        return self._file.entries[self.index].parent

    @property
    def num_heads(self) -> int:
        """KV heads per layer (the largest, if layers differ; see ``layers[i].num_heads``)."""
        return max((layer.num_heads for layer in self.layers if layer.present), default=0)

    @property
    def head_dim(self) -> int:
        """K head dim in elements (the largest, if layers differ; see ``layers[i].k_dim``)."""
        return max((layer.k_dim for layer in self.layers if layer.present), default=0)

    @property
    def seq_len(self) -> int:
        """One past the largest position held by any layer, head or sequence of this snapshot."""
        return self._segments.end()

    @functools.cached_property
    def incomplete(self) -> tuple[tuple[int, int, int, int], ...]:
        """The heads of a snapshot rebuilt by an earlier ``recover`` from a cut file (metadata
        ``recovered``) that stop short of the others: ``(layer, seq, head, end)`` each, ``end``
        one past the last position the head holds (0: no rows), below `seq_len`. Empty for every
        other snapshot, and for a recovered one whose every head reached the same position
        (which `kvformat.recover` now ensures). `head` refuses those heads."""
        if not self.snapshot_metadata.get("recovered"):
            return ()
        ends = self._segments.head_ends()
        top = max(ends.values(), default=0)
        return tuple(
            (layer, seq, head, ends.get((layer, seq, head), 0))
            for layer, spec in enumerate(self.layers)
            if spec.present
            for seq in range(self.num_seqs)
            for head in range(spec.num_heads)
            if ends.get((layer, seq, head), 0) < top
        )

    def describe_incomplete(self) -> str:
        """One line on `incomplete` ("" when the snapshot is whole)."""
        short = self.incomplete
        if not short:
            return ""
        layers = sorted({layer for layer, _, _, _ in short})
        shown = ", ".join(map(str, layers[:8])) + (" ..." if len(layers) > 8 else "")
        return (
            f"snapshot {self.index} was rebuilt from a cut file and is incomplete: {len(short)} head(s) "
            f"of layer(s) {shown} stop before position {self.seq_len}"
        )

    @property
    def num_chunks(self) -> int:
        return len(self._file.table)

    @property
    def array_names(self) -> list[str]:
        """Names of the arrays attached to this snapshot (e.g. ``"last_logits"``)."""
        return sorted(self._arrays)

    def array_chunk(self, name: str) -> int | None:
        """The chunk index of the array ``name`` attached to this snapshot, or None."""
        chunk = self._arrays.get(name)
        return int(chunk) if chunk is not None else None

    def array(self, name: str) -> np.ndarray | None:
        """An array attached to this snapshot, ``(rows, width)``, or None if there is none."""
        chunk = self._arrays.get(name)
        if chunk is None:
            return None
        check_arrays(self._file, self.index, {name: chunk})
        return self._file.chunk_array(chunk)

    def select(self, index: int) -> Snapshot:
        """Another snapshot of the same open file (shares the file; close either to close)."""
        return Snapshot(self._file, index)

    def positions(self, layer: int, head: int = 0, seq: int = 0) -> np.ndarray | None:
        """Absolute positions ``(n_tokens,)`` one head holds, without reading any K/V."""
        if self._layer(layer, head, seq) is None:
            return None
        return self._segments.positions_of_head(layer, seq, head)

    # -- data ------------------------------------------------------------------------------
    def _layer(self, layer: int, head: int, seq: int) -> LayerSpec | None:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise OutOfRangeError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        if not isinstance(seq, int) or not 0 <= seq < self.num_seqs:
            raise OutOfRangeError(f"seq {seq} out of range 0..{self.num_seqs - 1}")
        spec = self.layers[layer]
        if not spec.present:
            return None
        if not isinstance(head, int) or not 0 <= head < spec.num_heads:
            raise OutOfRangeError(f"head {head} out of range 0..{spec.num_heads - 1} in layer {layer}")
        return spec

    def head(
        self,
        layer: int,
        head: int,
        seq: int = 0,
        positions: tuple[int, int] | range | None = None,
        *,
        tokens: tuple[int, int] | range | None = None,
        values: bool = True,
    ) -> Head | None:
        """K, V and positions of one head, or ``None`` if ``layer`` is absent from the file.

        ``positions=(start, stop)`` (or ``range(start, stop)``) keeps absolute positions
        ``start <= p < stop``; ``tokens=`` is its former name (deprecated). A single raw chunk
        comes back as a zero-copy read-only view; anything else is one new array.
        ``values=False`` leaves V unread (``v`` is then empty, ``(0, v_dim)``): a pass that needs
        the keys alone reads half the bytes.
        """
        if tokens is not None:
            positions = _former_tokens(positions, tokens)
        spec = self._layer(layer, head, seq)
        if spec is None:
            return None
        assert spec.dtype is not None
        self._check_whole(layer, seq, head)
        segments = self._segments.of_head(layer, seq, head)
        start, stop = _position_range(positions)
        wanted = [s for s in segments if max(start, s.position) < min(stop, s.position + s.count)]
        self._file.prefetch(_chunks_of(wanted, values))
        k_parts, v_parts, pos_parts = self._head_parts(wanted, start, stop, values)
        no_rows = np.empty((0, spec.v_dim), spec.dtype.numpy)
        if not k_parts:
            return Head(
                layer, head, seq, np.empty((0, spec.k_dim), no_rows.dtype), no_rows, np.empty(0, np.int64)
            )
        return Head(layer, head, seq, *_joined(k_parts, v_parts if values else [no_rows], pos_parts))

    def _head_parts(
        self, segments: list[Any], start: int, stop: int, values: bool
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """K rows, V rows (none without ``values``) and positions of ``segments`` between
        positions ``start`` and ``stop``, a part per segment (views of its chunks)."""
        k_parts: list[np.ndarray] = []
        v_parts: list[np.ndarray] = []
        pos_parts: list[np.ndarray] = []
        for seg in segments:
            first = max(start, seg.position)
            last = min(stop, seg.position + seg.count)
            if first >= last:
                continue
            skip, n = first - seg.position, last - first
            k_parts.append(self._file.chunk_array(seg.k_chunk)[seg.k_row + skip :][:n])
            if values:
                v_parts.append(self._file.chunk_array(seg.v_chunk)[seg.v_row + skip :][:n])
            pos_parts.append(np.arange(first, last, dtype=np.int64))
        return k_parts, v_parts, pos_parts

    def _check_whole(self, layer: int, seq: int, head: int) -> None:
        """Refuse a head that a cut file's rebuilt snapshot holds only in part (`incomplete`)."""
        for short in self.incomplete:
            if short[:3] == (layer, seq, head):
                raise IncompleteSnapshotError(
                    f"{self.name}: {self.describe_incomplete()}; layer {layer} head {head} ends at "
                    f"position {short[3]}: select an earlier snapshot"
                )

    def _dropped_rows(self, layer: int, head: int, seq: int, positions: np.ndarray) -> Head:
        """K and V at ``positions`` (increasing) that this snapshot no longer holds, from the
        snapshots it descends from, nearest first (where the window of a rotating or
        sliding-window layer left them). Positions found nowhere are absent from the result."""
        spec = self._layer(layer, head, seq)
        assert spec is not None and spec.dtype is not None
        wanted = np.asarray(positions, np.int64)
        found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        cursor = self.parent
        while cursor is not None and wanted.size:
            runs = self._file.chain.appended(cursor)
            runs = runs[(runs[:, LAYER] == layer) & (runs[:, SEQ] == seq) & (runs[:, HEAD] == head)]
            k_at, k = self._rows_at(runs[runs[:, KIND] == KIND_K], wanted, spec.k_dim, spec.dtype.numpy)
            v_at, v = self._rows_at(runs[runs[:, KIND] == KIND_V], wanted, spec.v_dim, spec.dtype.numpy)
            both, k_index, v_index = np.intersect1d(k_at, v_at, assume_unique=True, return_indices=True)
            if both.size:
                found.append((both, k[k_index], v[v_index]))
                wanted = np.setdiff1d(wanted, both, assume_unique=True)
            cursor = self._file.entries[cursor].parent
        if not found:
            empty = spec.dtype.numpy
            return Head(
                layer, head, seq, np.empty((0, spec.k_dim), empty), np.empty((0, spec.v_dim), empty),
                np.empty(0, np.int64),
            )  # fmt: skip
        at = np.concatenate([f[0] for f in found])
        order = np.argsort(at, kind="stable")
        k_rows = np.concatenate([f[1] for f in found])[order]
        v_rows = np.concatenate([f[2] for f in found])[order]
        return Head(layer, head, seq, k_rows, v_rows, at[order])

    def _rows_at(
        self, runs: np.ndarray, wanted: np.ndarray, width: int, dtype: np.dtype
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(positions, rows)``: the rows of ``runs`` (one kind of one head) at any of ``wanted``
        (increasing), positions increasing within each run."""
        positions, rows = [np.empty(0, np.int64)], [np.empty((0, width), dtype)]
        for run in runs.tolist():
            position, count = run[POSITION], run[COUNT]
            low, high = np.searchsorted(wanted, [position, position + count])
            if low == high:
                continue
            at = wanted[low:high]
            positions.append(at)
            rows.append(self._file.chunk_array(run[CHUNK])[run[ROW] + at - position])
        return np.concatenate(positions), np.concatenate(rows)

    @functools.cached_property
    def _query_chunks(self) -> np.ndarray:
        """This snapshot's Q chunks, checked on first use (format 1.3)."""
        return check_queries(self._file, self.index)

    def queries(
        self, layer: int, head: int, seq: int = 0, positions: tuple[int, int] | range | None = None
    ) -> Queries | None:
        """The queries of query head ``head`` of ``layer`` (format 1.3): ``q`` ``(n, dim)``
        post-RoPE as the attention kernel received them, at absolute ``positions``
        (``(start, stop)`` keeps ``start <= p < stop``). None for an absent layer; ValueError for
        a layer that holds no queries (captured without ``--queries``)."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise OutOfRangeError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        spec = self.layers[layer]
        if not spec.present:
            return None
        if spec.queries is None:
            raise NoQueriesError(
                f"layer {layer} of {self.name} holds no queries: capture with --queries (queries=...)"
            )
        if not isinstance(head, int) or not 0 <= head < spec.queries.num_heads:
            raise OutOfRangeError(f"query head {head} out of range 0..{spec.queries.num_heads - 1}")
        if not isinstance(seq, int) or not 0 <= seq < self.num_seqs:
            raise OutOfRangeError(f"seq {seq} out of range 0..{self.num_seqs - 1}")
        start, stop = _position_range(positions)
        q, found = read_queries(self._file, self._query_chunks, layer, head, seq, start, stop)
        return Queries(layer, head, seq, q, found)

    def selection(
        self, layer: int, seq: int = 0, positions: tuple[int, int] | range | None = None
    ) -> Selection | None:
        """The key selections of ``layer`` (format 1.7, sparse attention: the keys an indexer let
        each query attend, shared by the layer's query heads), at ``positions`` (``(start,
        stop)``); None where the layer records none (dense attention, or no queries)."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise OutOfRangeError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        spec = self.layers[layer]
        if not spec.present or spec.queries is None or spec.queries.selection is None:
            return None
        if not isinstance(seq, int) or not 0 <= seq < self.num_seqs:
            raise OutOfRangeError(f"seq {seq} out of range 0..{self.num_seqs - 1}")
        start, stop = _position_range(positions)
        rows, found = read_selection(self._file, self._query_chunks, layer, seq, start, stop)
        return Selection(layer, seq, rows, found)

    def attention(
        self,
        layer: int,
        head: int,
        *,
        queries: tuple[int, int] | range | None = None,
        keys: tuple[int, int] | range | None = None,
        seq: int = 0,
    ) -> Attention:
        """Softmax attention weights of query head ``head`` of ``layer``, recomputed in float32
        with the mask, scale, softcap and sinks the file records (`kvformat.attention`):
        ``weights`` ``(n_queries, n_keys)`` for the queries at ``queries`` positions over the
        keys this snapshot holds (``keys=(start, stop)``: those columns only)."""
        return attention.attention(self, layer, head, queries=queries, keys=keys, seq=seq)

    def attention_output(
        self, layer: int, head: int, *, queries: tuple[int, int] | range | None = None, seq: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(weights @ V, positions)``: what attention returned for query head ``head``,
        ``(n_queries, v_dim)`` float32, a block of queries at a time."""
        return attention.attention_output(self, layer, head, queries=queries, seq=seq)

    def quantized_head(self, layer: int, head: int, seq: int = 0) -> tuple[Parts, Parts, np.ndarray] | None:
        """K and V of a quantized layer as stored: ``(packed, scales, biases)`` each, plus
        positions; None for an absent layer. Raises ValueError for an unquantized layer."""
        spec = self._layer(layer, head, seq)
        if spec is None:
            return None
        if spec.quantization is None:
            raise InvalidArgumentError(f"layer {layer} is not quantized")
        self._check_whole(layer, seq, head)
        segments = self._segments.of_head(layer, seq, head)
        k_parts = [self._file.chunk_parts(s.k_chunk) for s in segments]
        v_parts = [self._file.chunk_parts(s.v_chunk) for s in segments]

        def join(parts: list[Parts], rows: list[tuple[int, int]]) -> Parts:
            assert spec is not None and spec.dtype is not None
            if not parts:
                empty = spec.quantization.widths(spec.k_dim)  # type: ignore[union-attr]
                return (
                    np.empty((0, empty[0]), "<u4"),
                    np.empty((0, empty[1]), spec.dtype.numpy),
                    np.empty((0, empty[1]), spec.dtype.numpy),
                )
            return tuple(  # type: ignore[return-value]
                np.concatenate([p[j][lo : lo + n] for p, (lo, n) in zip(parts, rows, strict=True)])
                for j in range(3)
            )

        k = join(k_parts, [(s.k_row, s.count) for s in segments])
        v = join(v_parts, [(s.v_row, s.count) for s in segments])
        return k, v, _positions(segments)

    def heads(self, seq: int = 0) -> Iterator[Head]:
        """Every present (layer, head) of one sequence, layer-major, one head in memory at a time."""
        for layer, spec in enumerate(self.layers):
            for head in range(spec.num_heads if spec.present else 0):
                result = self.head(layer, head, seq)
                assert result is not None
                yield result

    def segments(self) -> list[Segment]:
        """All segments of this snapshot in file order of their K chunk (refused for a snapshot
        that holds some heads only in part: `incomplete`)."""
        if self.incomplete:
            raise IncompleteSnapshotError(
                f"{self.name}: {self.describe_incomplete()}: select an earlier snapshot"
            )
        return self._segments.in_file_order()

    def blocks(self, hold: int | Callable[[], int] = 0) -> Iterator[Head]:
        """Stream the snapshot segment by segment in file order: a `Head` holding one run.

        Pages of a block's chunks are released from this process once ``hold + 1`` more blocks
        have been requested (the next one, by default), so a pass over a file larger than memory
        keeps a bounded resident set; a consumer that works on ``hold`` blocks at once (threads)
        keeps them resident until it is done with them. ``hold`` may be a function, asked at each
        step (a consumer whose number of blocks in flight varies). Released views stay valid (the
        pages fault back in).
        """
        if not callable(hold) and (not isinstance(hold, int) or hold < 0):
            raise InvalidArgumentError(f"hold must be a non-negative integer, not {hold!r}")
        holding = hold if callable(hold) else (lambda: hold)
        segments = self.segments()
        announced = 0
        held: collections.deque[Segment] = collections.deque()
        for i, seg in enumerate(segments):
            if i == announced:  # read-ahead for remote sources (a no-op on a memory map)
                announced = self._read_ahead(segments, announced)
            yield self.read(seg)
            held.append(seg)
            keep = holding()
            while len(held) > keep:
                self._pages.release(held.popleft())

    def _read_ahead(self, segments: list[Segment], first: int) -> int:
        """Announce segments from ``first`` on, about `READ_AHEAD` bytes of them (at least one),
        to the page source; the index of the first one not announced."""
        budget, ahead, stop = READ_AHEAD, list[Segment](), first
        while stop < len(segments) and (budget > 0 or not ahead):
            segment = segments[stop]
            ahead.append(segment)
            budget -= (
                self._file.chunk(segment.k_chunk).stored_size + self._file.chunk(segment.v_chunk).stored_size
            )
            stop += 1
        self._pages.prefetch(ahead)
        return stop

    def read(self, segment: Segment) -> Head:
        """One segment of `segments()` as a `Head`: its K and V rows decoded (CRC-checked when
        the file was opened with checks; a view of the map for raw chunks), its positions.
        Thread-safe: a pass may read segments on several threads."""
        return self._pages.read(segment)

    @functools.cached_property
    def _pages(self) -> Pages:
        """Page management for a pass over the whole file (`kvformat.pages.Pages`, reached through
        `kvformat.pages.of`): batched reads, CRCs left to the caller, releasing and prefetching
        the pages of chunks."""
        return Pages(self._file)

    def _check_snapshots(self) -> None:
        """Check that every snapshot of the file materializes (section 11), each entry once."""
        self._file.chain.check_all()
        for i, entry in enumerate(self._file.entries):
            check_arrays(self._file, i, entry.arrays)
        check_all_queries(self._file)

    def verify(self) -> VerifyReport:
        """Check every CRC, every record, padding, the index copy and every snapshot.

        Raises the first problem found as a `KVFormatError` naming the chunk (layer, head, K/V,
        positions), and `IncompleteSnapshotError` for a snapshot rebuilt from a cut file that holds
        some heads only in part (`incomplete`); returns a `VerifyReport` when the whole file is
        sound.
        """
        report = verify(self._file)
        for i, entry in enumerate(self._file.entries):
            if entry.metadata.get("recovered"):
                rebuilt = self.select(i)
                if rebuilt.incomplete:
                    raise IncompleteSnapshotError(f"{self.name}: {rebuilt.describe_incomplete()}")
        return report

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        self._file.source.close()

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<kvformat.Snapshot {self.name!r} v{self.version[0]}.{self.version[1]} "
            f"snapshot {self.index} of 0..{self.num_snapshots - 1}: {self.num_layers} layers, "
            f"{self.num_heads} kv heads, head_dim {self.head_dim}, seq_len {self.seq_len}>"
        )


def _positions(segments: list[Segment]) -> np.ndarray:
    return ranges(
        np.array([s.position for s in segments], np.int64), np.array([s.count for s in segments], np.int64)
    )


def _position_range(positions: tuple[int, int] | range | None) -> tuple[int, int]:
    """``[start, stop)`` of absolute positions (everything for None)."""
    if positions is None:
        return 0, MAX_POSITION
    if isinstance(positions, range):
        if positions.step != 1:
            raise InvalidArgumentError("a positions range must have step 1")
        return positions.start, positions.stop
    start, stop = positions
    return int(start), int(stop)


def open(
    file: str | os.PathLike[str] | BinaryIO,
    snapshot: int = -1,
    *,
    check_checksums: bool = True,
    filesystem: Any = None,
    storage_options: dict[str, Any] | None = None,
    timeout: float = remote.DEFAULT_TIMEOUT,
) -> Snapshot:
    """Open a `.kv` file: a local path (memory-mapped), a seekable binary file object, a URL
    (``http(s)://`` with the standard library; ``s3://`` and other fsspec schemes with
    ``storage_options``), or a path inside ``filesystem`` (an fsspec or pyarrow filesystem).

    Reads only the header, footer and index. ``snapshot`` selects which snapshot of a series
    (default: the last). ``check_checksums`` verifies each chunk's CRC-32C as it is read.
    ``timeout`` (seconds) bounds each network operation of a remote file.
    """
    source = open_source(file, filesystem=filesystem, storage_options=storage_options, timeout=timeout)
    try:
        return Snapshot(FileStructure(source, check_checksums), snapshot)
    except BaseException:
        source.close()
        raise
