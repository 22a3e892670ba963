"""Streaming writer: append K/V token ranges as they arrive, commit snapshots, index at the end.

The writer appends to ``PATH.partial``; ``close()`` writes the index and footer, fsyncs and
renames to ``PATH``. A crash leaves only the ``.partial`` file, which `kvformat.recover` turns into
a valid snapshot of every complete chunk.

Memory: the index (64 bytes per chunk) plus, while an append is being written, its work units in
flight: up to ``_AHEAD + 2`` units of about `_UNIT_BYTES` each (gathered strided rows in reused
scratch buffers, encoded chunks for a compressing codec). Contiguous raw input is written straight
from the caller's arrays, without a copy, but for small chunks: those are copied into one buffer
and written with one call (`kvformat.records.block_records`). The file's data is never held whole.

This module holds the writer's state and its I/O; the record layout is `kvformat.records`, units
of chunks become records in `kvformat.encode`, the checks of appended input are
`kvformat.write_input`, the closing index section `kvformat.index`, and whole-snapshot writes
(`save`, `write_snapshot`) `kvformat.saving`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, cast

import numpy as np

from kvformat import codecs, dtypes
from kvformat.checksum import crc32c
from kvformat.codecs import BytesLike, Codec
from kvformat.encode import ZEROS, prepare
from kvformat.errors import (
    InvalidArgumentError,
    InvalidArrayError,
    NoQueriesError,
    OutOfRangeError,
    WriterClosedError,
)
from kvformat.index import index_bytes
from kvformat.io.durability import fsync_directory
from kvformat.io.outputs import check_output, lock_for_writing, publish
from kvformat.layout import (
    DESCRIPTOR_SIZE,
    KIND_ARRAY,
    KIND_K,
    KIND_MANIFEST,
    KIND_Q,
    KIND_SELECTION,
    KIND_SNAPSHOT,
    KIND_V,
    MAX_POSITION,
    Descriptor,
    align,
    pack_header,
)
from kvformat.manifest import (
    CHUNKED_ATTENTION,
    LATENT_ATTENTION,
    POOLED_ATTENTION,
    QUERIES,
    SPARSE_ATTENTION,
    LayerSpec,
    Manifest,
    QuerySpec,
    dumps,
    format_minor,
)
from kvformat.records import (
    Block,
    Part,
    Records,
    Unit,
    flat,
)
from kvformat.runs import CHUNK, COUNT, HEAD, KIND, LAYER, POSITION, ROW, SEQ, trim_runs
from kvformat.series import Entry, chunk_ranges
from kvformat.write_input import (
    as_positions,
    block_start,
    checked_layout,
    input_bytes,
    owned_copy,
    plain_arrays,
    rows_of,
)

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
PIPELINE_BYTES = 2 << 20  # appends this large are prepared on a helper thread while being written
_UNIT_BYTES = 4 << 20  # chunks are prepared and written in units of about this many bytes
_AHEAD = 2  # work units prepared ahead of the one being written
GATHER_BYTES = 16 << 20
"""`Writer.append` gathers (copies of) items up to this size and writes them together at the next
snapshot, or once this many bytes wait: one bulk write per snapshot, as `Writer.append_many`."""
_HAS_WRITEV = hasattr(os, "writev")  # not on Windows
_IOV_MAX = 1024  # buffers per writev call (POSIX guarantees at least 16; Linux and macOS allow 1024)


# The pending-appends table has the columns of `kvformat.series`' runs (LAYER .. POSITION): one
# row per K/V chunk run not yet in a snapshot.


def _required_features(specs: Sequence[LayerSpec], given: Sequence[str]) -> list[str]:
    """``given`` and the features the layers' queries need: ``queries`` (format 1.3: a 1.2
    reader refuses the file, never misreads it), chunked and latent attention (1.6: a 1.5 reader
    refuses them, never ignores the chunks or the latent layout)."""
    features = list(given)
    queries = [spec.queries for spec in specs if spec.queries is not None]
    needed = (
        (QUERIES, bool(queries)),
        (CHUNKED_ATTENTION, any(q.chunk is not None for q in queries)),
        (LATENT_ATTENTION, any(q.latent for q in queries)),
        (SPARSE_ATTENTION, any(q.selection is not None for q in queries)),
        (POOLED_ATTENTION, any(q.pooled is not None for q in queries)),
    )
    features += [name for name, wanted in needed if wanted and name not in features]
    return features


class Writer:
    """Write one `.kv` file incrementally.

    ``layers`` declares every layer up front (`LayerSpec`, or ``None`` for an absent layer).
    ``durable=False`` skips the fsyncs at close (the rename stays atomic, but a power loss may
    lose the file); for scratch files on tmpfs or benchmarks against non-syncing peers.
    An existing ``path`` is refused (`kvformat.io.outputs.OutputExistsError`, when the writer is
    made and again at close) unless ``overwrite=True``. The ``.partial`` file is locked
    (``flock``) while it is written, so `kvformat.recover` can tell a live write from a crash.
    ``append`` adds tokens to a layer, ``drop`` removes positions from the live state (a sliding
    window moving on), ``snapshot`` commits the live state of every layer as one snapshot.
    Chunks already written are shared by later snapshots, so a series costs only what is new.

    Large appends are pipelined: a helper thread gathers strided rows into contiguous buffers,
    encodes and checksums the next chunks while the calling thread writes the current ones.
    Descriptors, checksums and index entries of a whole call are built with numpy, not chunk by
    chunk, so a snapshot of hundreds of small chunks costs about a millisecond.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layers: Sequence[LayerSpec | None],
        *,
        num_seqs: int = 1,
        metadata: dict[str, Any] | None = None,
        codec: str | Codec = "raw",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        required_features: Sequence[str] = (),
        optional_features: Sequence[str] = (),
        durable: bool = True,
        overwrite: bool = False,
    ) -> None:
        specs = checked_layout(layers, num_seqs, chunk_bytes)
        self.path = check_output(path, force=overwrite)
        self.partial_path = self.path + ".partial"
        self.durable = durable
        self.overwrite = overwrite
        self.codec = codecs.parse(codec)
        self.chunk_bytes = chunk_bytes
        features = _required_features(specs, required_features)
        self.manifest = Manifest(specs, num_seqs, dict(metadata or {}), features, list(optional_features))
        manifest_json = dumps(self.manifest.to_json())
        try:
            # Unbuffered: records go out in one writev each, straight from the caller's arrays.
            self._file = open(self.partial_path, "xb", buffering=0)  # noqa: SIM115 - closed in close()/abort()
        except FileExistsError:
            raise FileExistsError(
                f"{self.partial_path} exists: an earlier write did not finish. Run "
                f"'kvsnap recover {self.partial_path}' to keep its data, or delete it."
            ) from None
        lock_for_writing(self._file.fileno())
        self._start_state(specs, num_seqs)
        self._write_all([pack_header(format_minor(self.manifest))])
        self._write_json_record(KIND_MANIFEST, manifest_json)

    def _start_state(self, specs: Sequence[LayerSpec], num_seqs: int) -> None:
        """The bookkeeping of a file with nothing written yet but its header and manifest."""
        self._offset = 0
        self._table: list[bytes] = []  # packed descriptors of every table chunk, in chunk order
        self._chunks = 0  # table chunks written
        self._chunk_rows = np.zeros(1024, np.int64)  # rows of table chunk i (capacity doubles)
        # Row ``layer * num_seqs + seq``: one past the last position each head holds (0 for none),
        # ``(layers * num_seqs, most heads of a layer)``; one numpy call updates it per append.
        heads = max((spec.num_heads for spec in specs), default=0)
        self._ends = np.zeros((len(specs) * num_seqs, heads), np.int64)
        self._pending: list[np.ndarray] = []  # (n, 8) blocks of runs appended since the last snapshot
        self._pending_drops: list[tuple[int, int, int, int]] = []
        self._pending_queries: list[np.ndarray] = []  # Q chunk indices since the last snapshot
        self._snapshots: list[Entry] = []
        self._query_ends: dict[tuple[int, ...], int] = {}  # (layer, seq[, kind]) -> one past the last
        self._dirty = False
        self._closed = False
        # `append`'s small items, checked and copied, written together at the next snapshot (or
        # any other write, or past `GATHER_BYTES`); ``_following``: one past the last position
        # each gathered (layer, seq) takes.
        self._gathered: list[Part | Block] = []
        self._gathered_bytes = 0
        self._following: dict[tuple[int, int], int] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvformat-prepare")
        # Reused gather buffers, one per work unit in flight (no allocation, so no page faults,
        # per strided head; mlx-lm keeps V as a strided view).
        self._scratch = [np.empty(0, np.uint8) for _ in range(_AHEAD + 2)]
        self.pipeline_bytes = PIPELINE_BYTES

    # -- low level -----------------------------------------------------------------------
    def _write_all(self, buffers: Sequence[BytesLike], total: int | None = None) -> None:
        """Write ``buffers`` in order at the end of the file (``writev``, retried on short writes).
        With ``total`` (their size in bytes) they must be flat byte buffers: none is checked."""
        if total is None:
            views = [view for view in map(flat, buffers) if view.nbytes]
            total = sum(view.nbytes for view in views)
        else:
            views = cast(list[memoryview], list(buffers))
        fd = self._file.fileno()
        i, remaining = 0, total
        while i < len(views):
            batch = views[i : i + _IOV_MAX]
            written = os.writev(fd, batch) if _HAS_WRITEV else os.write(fd, batch[0])
            if written <= 0:
                raise OSError(f"{self.partial_path}: write made no progress")
            remaining -= written
            if _HAS_WRITEV and i + len(batch) == len(views) and remaining == 0:
                break  # the usual case: everything went out in one call
            i = _skip_written(views, i, written)
        self._offset += total

    def _write_json_record(self, kind: int, payload: bytes) -> None:
        descriptor = Descriptor(
            kind=kind,
            dtype=0,
            codec=0,
            layer=0,
            head=0,
            seq=0,
            position=0,
            rows=0,
            width=0,
            offset=self._offset,
            stored_size=len(payload),
            decoded_size=len(payload),
            payload_crc=crc32c(payload),
        )
        end = self._offset + DESCRIPTOR_SIZE + len(payload)
        self._write_all([descriptor.pack(), payload, ZEROS[: align(end) - end]])

    def _prepare(self, unit: Unit, slot: int, offset: int) -> Records:
        """The records of ``unit``, laid out from file offset ``offset`` (`kvformat.encode`), with
        scratch buffer ``slot``. Runs on the helper thread for pipelined appends and touches no
        writer state but the slot."""
        records, self._scratch[slot] = prepare(unit, self.codec, self._scratch[slot], offset)
        return records

    def _commit(self, records: Records) -> range:
        """Write prepared records (which must start at the current end of the file); return
        their chunk indices."""
        assert records.start == self._offset
        self._write_all(records.buffers, records.end - records.start)
        first = self._chunks
        count = records.columns.shape[0]
        self._chunks += count
        if count:
            self._table.append(records.packed)
            columns = records.columns
            columns[:, CHUNK] = np.arange(first, first + count)
            if first + count > self._chunk_rows.shape[0]:
                grown = np.zeros(max(2 * self._chunk_rows.shape[0], first + count), np.int64)
                grown[:first] = self._chunk_rows[:first]
                self._chunk_rows = grown
            self._chunk_rows[first : first + count] = columns[:, COUNT]
            queries = (columns[:, KIND] == KIND_Q) | (columns[:, KIND] == KIND_SELECTION)
            if queries.any():
                self._pending_queries.append(columns[queries, CHUNK].copy())
                self._dirty = True
            tensors = columns[(columns[:, KIND] != KIND_ARRAY) & ~queries]
            if tensors.shape[0]:
                self._pending.append(tensors)
                self._dirty = True
                self._advance_ends(tensors)
        return range(first, first + count)

    def _advance_ends(self, runs: np.ndarray) -> None:
        """Record that the heads of ``runs`` now hold positions up to each run's end."""
        rows = runs[:, LAYER] * self.manifest.num_seqs + runs[:, SEQ]
        np.maximum.at(self._ends, (rows, runs[:, HEAD]), runs[:, POSITION] + runs[:, COUNT])

    def _held(self, layer: int, seq: int) -> np.ndarray:
        """One past the last position each head of ``layer`` holds for ``seq``, ``(num_heads,)``
        (a view: writing to it changes the writer's state)."""
        return self._ends[layer * self.manifest.num_seqs + seq, : self.manifest.layers[layer].num_heads]

    def _run(self, parts: Sequence[Part | Block]) -> None:
        """Prepare and write ``parts`` in order, grouped into units of about `_UNIT_BYTES`;
        pipelined when there is enough to overlap."""
        units: list[Unit] = []
        size = _UNIT_BYTES
        total = 0
        for part in parts:
            if size >= _UNIT_BYTES:
                units.append([])
                size = 0
            units[-1].append(part)
            size += part.nbytes
            total += part.nbytes
        if len(units) < 2 or total < self.pipeline_bytes:
            for unit in units:
                self._commit(self._prepare(unit, 0, self._offset))
            return
        slots = len(self._scratch)  # the unit being written + _AHEAD + 1 being prepared
        end = [self._offset]  # where the next unit starts; only the helper thread moves it

        def prepare(i: int) -> Records:
            records = self._prepare(units[i], i % slots, end[0])
            end[0] = records.end
            return records

        pending = {i: self._pool.submit(prepare, i) for i in range(min(_AHEAD + 1, len(units)))}
        try:
            for i in range(len(units)):
                records = pending.pop(i).result()
                if i + _AHEAD + 1 < len(units):
                    pending[i + _AHEAD + 1] = self._pool.submit(prepare, i + _AHEAD + 1)
                self._commit(records)
        finally:
            for future in pending.values():
                future.cancel()
            wait(pending.values())  # no helper may still write into a scratch buffer

    def _check_after(self, layer: int, seq: int, position: int, head: int | None = None) -> None:
        """Every head of ``layer`` (or only ``head``) holds only positions before ``position``."""
        held = self._held(layer, seq)
        if head is None:
            head = int(np.argmax(held))
        if position < held[head]:
            raise InvalidArrayError(
                f"layer {layer} head {head} seq {seq}: position {position} is not after the "
                f"last position held ({int(held[head]) - 1})"
            )

    def _write_array(self, name: str, value: Any) -> int:
        if not isinstance(name, str) or not name:
            raise InvalidArrayError("array names must be non-empty strings")
        array = np.ascontiguousarray(value)
        if array.ndim == 1:
            array = array.reshape(1, -1)
        if array.ndim != 2:
            raise InvalidArrayError(f"array {name!r} must be 1-D or 2-D, got shape {array.shape}")
        dtype = dtypes.from_numpy(array.dtype)
        unit: Unit = [Part(KIND_ARRAY, 0, 0, 0, 0, array, array.shape[1], dtype)]
        return self._commit(self._prepare(unit, 0, self._offset))[0]

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(f"writer for {self.path} is closed")

    def _layer(self, layer: int) -> LayerSpec:
        if not isinstance(layer, int) or not 0 <= layer < len(self.manifest.layers):
            raise OutOfRangeError(f"layer {layer} out of range 0..{len(self.manifest.layers) - 1}")
        spec = self.manifest.layers[layer]
        if not spec.present:
            raise InvalidArgumentError(f"layer {layer} is declared absent; it cannot hold K/V")
        return spec

    def _check_seq(self, seq: int) -> None:
        if not isinstance(seq, int) or not 0 <= seq < self.manifest.num_seqs:
            raise OutOfRangeError(f"seq {seq} out of range 0..{self.manifest.num_seqs - 1}")

    # -- public API ----------------------------------------------------------------------
    def next_position(self, layer: int, seq: int = 0) -> int:
        """One past the last position any head of ``layer`` holds for ``seq`` (0 if empty)."""
        self._flush()
        return int(self._held(layer, seq).max(initial=0))

    def _flush(self) -> None:
        """Write what `append` gathered."""
        if self._gathered:
            parts, self._gathered, self._gathered_bytes, self._following = self._gathered, [], 0, {}
            self._run(parts)

    def append(self, layer: int, k: Any, v: Any, positions: Any = None, *, seq: int = 0) -> None:
        """Append tokens to every head of ``layer`` for sequence ``seq``.

        ``k``: ``(num_heads, n_tokens, k_dim)``, ``v``: ``(num_heads, n_tokens, v_dim)``, in the
        layer's dtype (strided views are fine); for a quantized layer each is a tuple ``(packed,
        scales, biases)`` of ``(num_heads, n_tokens, ...)`` arrays. ``positions``: ``(n_tokens,)``
        strictly increasing absolute positions after what the layer holds; default: continue
        from `next_position`.

        Items up to `GATHER_BYTES` are checked and copied now and written with the next snapshot
        (one bulk write, as `append_many`); larger ones are written at once.
        """
        size = input_bytes(k) + input_bytes(v)
        if size > GATHER_BYTES:
            self.append_many([(layer, k, v, positions, seq)])
            return
        self._check_open()
        parts = self._checked_parts([(layer, owned_copy(k), owned_copy(v), positions, seq)], self._following)
        self._gathered += parts
        self._gathered_bytes += size
        if self._gathered_bytes > GATHER_BYTES:
            self._flush()

    def append_queries(self, layer: int, q: Any, positions: Any, *, seq: int = 0) -> None:
        """Append queries (format 1.3) to every query head of ``layer`` for sequence ``seq``:
        ``q`` ``(num_query_heads, n_tokens, dim)`` in the layer's queries dtype, at ``positions``
        ``(n_tokens,)`` strictly increasing, after the last query position the layer holds. The
        layer must declare ``queries`` (`QuerySpec`). They join the next snapshot, and every later
        one (queries are never dropped)."""
        self._check_open()
        self._flush()
        spec = self._layer(layer)
        self._check_seq(seq)
        if spec.queries is None:
            raise NoQueriesError(f"layer {layer} declares no queries (LayerSpec(queries=QuerySpec(...)))")
        queries = spec.queries
        q = np.asarray(q) if not isinstance(q, np.ndarray) else q
        if q.ndim != 3 or q.shape[0] != queries.num_heads or q.shape[2] != queries.dim:
            raise InvalidArrayError(
                f"layer {layer}: queries must be (num_query_heads={queries.num_heads}, n_tokens, "
                f"dim={queries.dim}), got {q.shape}"
            )
        if q.dtype != queries.dtype.numpy:
            raise InvalidArrayError(f"layer {layer}: queries must be {queries.dtype.name}, got {q.dtype}")
        count = q.shape[1]
        pos = as_positions(positions, count)
        if not count:
            return
        key = (layer, seq)
        if int(pos[0]) < self._query_ends.get(key, 0):
            raise InvalidArrayError(
                f"layer {layer} seq {seq}: query position {int(pos[0])} is not after the last one "
                f"appended ({self._query_ends[key] - 1})"
            )
        self._query_ends[key] = int(pos[-1]) + 1
        self._run(self._query_parts(layer, seq, queries, q, pos))

    def append_selection(self, layer: int, rows: Any, positions: Any, *, seq: int = 0) -> None:
        """Append key selections (format 1.7, sparse attention) of ``layer`` for sequence
        ``seq``: ``rows`` ``(n_tokens, width)`` integer key positions, row ``i`` the keys the
        queries at ``positions[i]`` may attend (any order, no repeats; stored sorted), at
        ``positions`` ``(n_tokens,)`` strictly increasing, after the last selection the layer
        holds. The layer's queries must declare ``selection=width``. They join the next snapshot,
        and every later one."""
        self._check_open()
        self._flush()
        spec = self._layer(layer)
        self._check_seq(seq)
        queries = spec.queries
        if queries is None or queries.selection is None:
            raise NoQueriesError(f"layer {layer} declares no key selection (QuerySpec(selection=width))")
        ordered = _sorted_selection(layer, rows, queries.selection)
        count = ordered.shape[0]
        pos = as_positions(positions, count)
        if not count:
            return
        key = (layer, seq, KIND_SELECTION)
        if int(pos[0]) < self._query_ends.get(key, 0):
            raise InvalidArrayError(
                f"layer {layer} seq {seq}: selection position {int(pos[0])} is not after the last one "
                f"appended ({self._query_ends[key] - 1})"
            )
        self._query_ends[key] = int(pos[-1]) + 1
        table = ordered.astype("<i4")[None]  # one "head": selections are shared by every query head
        self._run(self._query_parts(layer, seq, queries, table, pos, KIND_SELECTION))

    def _query_parts(
        self, layer: int, seq: int, queries: QuerySpec, q: np.ndarray, pos: np.ndarray, kind: int = KIND_Q
    ) -> list[Part | Block]:
        """The chunks of ``q`` ``(num_query_heads, n, dim)`` at positions ``pos`` (a selection:
        ``(1, n, width)`` int32): per query head, per run of consecutive positions, split at
        ``chunk_bytes``."""
        width, dtype = (queries.dim, queries.dtype) if kind == KIND_Q else (q.shape[2], dtypes.INT32)
        rows_per_chunk = max(1, self.chunk_bytes // (width * dtype.itemsize))
        breaks = np.flatnonzero(np.diff(pos) != 1) + 1  # runs of consecutive positions
        runs = list(zip([0, *breaks.tolist()], [*breaks.tolist(), pos.shape[0]], strict=True))
        return [
            Part(
                kind,
                layer,
                seq,
                head,
                int(pos[first]),
                q[head, first : min(first + rows_per_chunk, stop)],
                width,
                dtype,
            )
            for head in range(q.shape[0])
            for start, stop in runs
            for first in range(start, stop, rows_per_chunk)
        ]

    def append_many(self, appends: Iterable[tuple[int, Any, Any, Any, int]]) -> None:
        """`append` for several layers (and sequences) at once: ``(layer, k, v, positions, seq)``
        items, written in order. One call for a whole cache lets the gathering, encoding and
        checksumming of one layer overlap the write of the previous one. Every item is checked
        before anything is written: a bad item writes nothing of the call."""
        self._check_open()
        self._flush()
        self._run(self._checked_parts(appends, {}))

    def _checked_parts(
        self, appends: Iterable[tuple[int, Any, Any, Any, int]], following: dict[tuple[int, int], int]
    ) -> list[Part | Block]:
        """The chunks of ``appends``, every item checked (shapes, dtypes, positions after what
        is written and after ``following``: the next default position of each (layer, seq) not
        yet written, updated)."""
        parts: list[Part | Block] = []
        held = self._ends.max(axis=1, initial=0).tolist()  # `next_position` of every (layer, seq)
        seqs = self.manifest.num_seqs
        for layer, k, v, positions, seq in appends:
            spec = self._layer(layer)
            self._check_seq(seq)
            start: int | None = None
            if positions is None:
                start = following.get((layer, seq))
                start = held[layer * seqs + seq] if start is None else start
            block = self._block(spec, layer, seq, k, v, positions, start)
            if block is not None:
                count, first, last = block.k.shape[1], block.position, block.position + block.k.shape[1] - 1
                if count:
                    self._check_order(following, held, layer, seq, first, last)
                    parts.append(block)
                continue
            heads, count = self._layer_rows(layer, spec, k, v)
            if start is not None:
                positions = np.arange(count, dtype=np.int64) + start
            pos = as_positions(positions, count)  # checked once for every head
            if count:
                self._check_order(following, held, layer, seq, int(pos[0]), int(pos[-1]))
            parts += self._parts(spec, layer, seq, heads, pos)
        return parts

    def _check_order(
        self,
        following: dict[tuple[int, int], int],
        held: list[int],
        layer: int,
        seq: int,
        first: int,
        last: int,
    ) -> None:
        """Positions ``first..last`` come after what the layer holds (``held``: `next_position`
        of each ``(layer, seq)`` row when the call began) and what this call appended."""
        earlier = following.get((layer, seq))
        if earlier is None:
            if first < held[layer * self.manifest.num_seqs + seq]:
                self._check_after(layer, seq, first)  # names the head
        elif first < earlier:
            raise InvalidArrayError(
                f"layer {layer} seq {seq}: position {first} is not after the last position "
                f"appended earlier in this call ({earlier - 1})"
            )
        following[(layer, seq)] = last + 1

    def _block(
        self, spec: LayerSpec, layer: int, seq: int, k: Any, v: Any, positions: Any, start: int | None
    ) -> Block | None:
        """``k``/``v`` as one `Block` when they can be stored that way (raw codec, plain dtype,
        C-contiguous numpy arrays of the right shape, consecutive positions within one chunk per
        head); None otherwise, and the general path checks and splits them."""
        if self.codec.code != 0 or not plain_arrays(spec, k, v):
            return None
        assert spec.dtype is not None
        count = k.shape[1]
        if count * max(spec.row_bytes(KIND_K), spec.row_bytes(KIND_V)) > self.chunk_bytes:
            return None
        start = block_start(positions, count, start)
        return None if start is None else Block(layer, seq, start, k, v, spec.dtype)

    def _layer_rows(
        self, layer: int, spec: LayerSpec, k: Any, v: Any
    ) -> tuple[list[tuple[int, np.ndarray, np.ndarray]], int]:
        """Per head ``(head, k_rows, v_rows)`` as stored before the codec, and the token count;
        ``k``/``v`` ``(num_heads, n_tokens, dim)``, or ``(packed, scales, biases)`` with that
        leading shape for a quantized layer. Checked once for the whole layer."""
        heads = (spec.num_heads,)
        k_rows = rows_of(spec, f"layer {layer} k", k, spec.k_dim, heads)
        v_rows = rows_of(spec, f"layer {layer} v", v, spec.v_dim, heads)
        count = k_rows[0].shape[0] if spec.num_heads else 0
        if spec.num_heads and v_rows[0].shape[0] != count:
            raise InvalidArrayError(f"layer {layer}: k has {count} tokens, v has {v_rows[0].shape[0]}")
        return [(h, k_rows[h], v_rows[h]) for h in range(spec.num_heads)], count

    def _parts(
        self,
        spec: LayerSpec,
        layer: int,
        seq: int,
        heads: list[tuple[int, np.ndarray, np.ndarray]],
        pos: np.ndarray,
    ) -> list[Part]:
        """The chunks for ``heads`` at positions ``pos``: one per head, kind and run of consecutive
        positions (split at ``chunk_bytes``), in record order: head by head, K before V."""
        assert spec.dtype is not None
        count = pos.shape[0]
        if count == 0:
            return []
        rows_per_chunk = max(1, self.chunk_bytes // max(spec.row_bytes(KIND_K), spec.row_bytes(KIND_V)))
        # Strictly increasing, so a span of count - 1 means one contiguous run (the usual case).
        contiguous = int(pos[-1]) - int(pos[0]) == count - 1
        breaks = [] if contiguous else (np.flatnonzero(np.diff(pos) != 1) + 1).tolist()
        slices = [
            (first, min(stop, first + rows_per_chunk))
            for start, stop in zip([0, *breaks], [*breaks, count], strict=True)
            for first in range(start, stop, rows_per_chunk)
        ]
        dtype = spec.dtype
        return [
            part
            for head, k_rows, v_rows in heads
            for first, last in slices
            for part in (
                Part(KIND_K, layer, seq, head, int(pos[first]), k_rows[first:last], spec.k_dim, dtype),
                Part(KIND_V, layer, seq, head, int(pos[first]), v_rows[first:last], spec.v_dim, dtype),
            )
        ]

    def append_head(self, layer: int, head: int, k: Any, v: Any, positions: Any, *, seq: int = 0) -> None:
        """Append tokens to one head: ``k`` ``(n_tokens, k_dim)``, ``v`` ``(n_tokens, v_dim)``
        (for a quantized layer, ``(packed, scales, biases)`` tuples)."""
        self._check_open()
        self._flush()
        spec = self._layer(layer)
        self._check_seq(seq)
        if not isinstance(head, int) or not 0 <= head < spec.num_heads:
            raise OutOfRangeError(f"head {head} out of range 0..{spec.num_heads - 1} in layer {layer}")
        where = f"layer {layer} head {head}"
        k_rows = rows_of(spec, f"{where} k", k, spec.k_dim, ())
        v_rows = rows_of(spec, f"{where} v", v, spec.v_dim, ())
        if k_rows.shape[0] != v_rows.shape[0]:
            raise InvalidArrayError(f"{where}: k has {k_rows.shape[0]} tokens, v has {v_rows.shape[0]}")
        pos = as_positions(positions, k_rows.shape[0])
        if pos.size:
            self._check_after(layer, seq, int(pos[0]), head)
        self._run(self._parts(spec, layer, seq, [(head, k_rows, v_rows)], pos))

    def drop(self, layer: int, start: int, stop: int, *, seq: int = 0) -> None:
        """Remove positions ``[start, stop)`` from every head of ``layer`` in the live state.

        Nothing is erased from the file; later snapshots simply stop referring to those rows.
        Positions must increase within what a snapshot holds, not over the file's history: once
        the last positions are dropped, the next `append` continues from ``start`` and may take
        dropped positions again. That is what a trimmed cache does (mlx-lm's ``trim_prompt_cache``
        after rejected draft tokens: the accepted tokens take the same positions), and SPEC
        section 11 materializes it: the drop removes the old rows, the append adds the new ones.
        """
        self._check_open()
        self._flush()
        self._layer(layer)
        self._check_seq(seq)
        if not (type(start) is int and type(stop) is int and 0 <= start <= stop <= MAX_POSITION):
            raise InvalidArgumentError(f"drop range must be integers 0 <= start <= stop, got {start}, {stop}")
        held = self._held(layer, seq)
        # A head whose last position was dropped may take positions from ``start`` on again.
        held[(held > start) & (held <= stop)] = start
        if self._pending:
            self._pending = [trim_runs(np.concatenate(self._pending), start, stop, layer, seq)]
        self._pending_drops.append((layer, seq, start, stop))
        self._dirty = True

    def snapshot(self, metadata: dict[str, Any] | None = None, arrays: dict[str, Any] | None = None) -> int:
        """Commit the live state of every layer as a new snapshot; return its index.

        ``arrays`` attaches named arrays to this snapshot (e.g. ``"last_logits"``:
        ``(num_seqs, vocab)`` float32), each stored as one array chunk.
        """
        self._check_open()
        self._flush()
        attached = {name: self._write_array(name, value) for name, value in (arrays or {}).items()}
        runs = np.concatenate(self._pending) if self._pending else np.empty((0, 8), np.int64)
        # Chunks appended whole (not trimmed by a drop since) go in as ranges of chunk indices
        # (`append_chunks`); what a drop cut goes in as (chunk, row, count) triples.
        whole = (runs[:, ROW] == 0) & (runs[:, COUNT] == self._chunk_rows[runs[:, CHUNK]])
        ranges = chunk_ranges(np.sort(runs[whole, CHUNK]))
        cut = runs[~whole]
        # Sorted by (layer, seq, head, kind), in append order within each: a stable sort.
        cut = cut[np.lexsort((cut[:, KIND], cut[:, HEAD], cut[:, SEQ], cut[:, LAYER]))]
        queries = np.concatenate(self._pending_queries) if self._pending_queries else np.empty(0, np.int64)
        entry = Entry(
            parent=len(self._snapshots) - 1 if self._snapshots else None,
            drops=self._pending_drops,
            appends=cut[:, [CHUNK, ROW, COUNT]],
            metadata=dict(metadata or {}),
            arrays=attached,
            chunk_ranges=ranges,
            query_ranges=chunk_ranges(np.sort(queries)),
        )
        self._write_json_record(KIND_SNAPSHOT, dumps(entry.to_json()))
        self._snapshots.append(entry)
        self._pending, self._pending_drops, self._pending_queries = [], [], []
        self._dirty = False
        return len(self._snapshots) - 1

    def fileno(self) -> int:
        """The descriptor of the ``.partial`` file being written (e.g. to sync it early)."""
        return self._file.fileno()

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def close(self, metadata: dict[str, Any] | None = None) -> None:
        """Commit pending state, write index and footer, fsync and rename into place.

        ``metadata`` keys are merged into the file-level metadata (e.g. the generated text).
        """
        if self._closed:
            return
        if metadata:
            self.manifest.metadata.update(metadata)
        self._flush()
        if self._dirty or not self._snapshots:
            self.snapshot()
        self._write_all([index_bytes(self._offset, self._table, self.manifest, self._snapshots)])
        self._file.flush()
        if self.durable:
            os.fsync(self._file.fileno())
        self._file.close()
        self._pool.shutdown()
        self._closed = True
        publish(self.partial_path, self.path, force=self.overwrite)
        if self.durable:
            fsync_directory(self.path)

    def abort(self) -> None:
        """Stop writing and delete the partial file."""
        if self._closed:
            return
        self._closed = True
        self._file.close()
        self._pool.shutdown()
        os.unlink(self.partial_path)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            # Keep what was written, and what was gathered: `kvsnap recover` can rebuild it.
            with contextlib.suppress(Exception):
                self._flush()
            self._closed = True
            self._file.close()
            self._pool.shutdown()


def _sorted_selection(layer: int, rows: Any, width: int) -> np.ndarray:
    """``rows`` ``(n, width)`` of distinct key positions in ``0 .. 2^31-1``, each sorted, as
    int64; `InvalidArrayError` otherwise."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] != width or rows.dtype.kind not in "iu":
        raise InvalidArrayError(
            f"layer {layer}: selections must be integers (n_tokens, width={width}), "
            f"got {rows.dtype} {rows.shape}"
        )
    ordered = np.sort(rows.astype(np.int64), axis=1)
    if ordered.size and (
        int(ordered[:, 0].min()) < 0
        or int(ordered[:, -1].max()) > np.iinfo(np.int32).max
        or bool(np.any(ordered[:, 1:] == ordered[:, :-1]))
    ):
        raise InvalidArrayError(
            f"layer {layer}: a selection row must name distinct key positions in 0..2^31-1"
        )
    return ordered


def _skip_written(views: list[memoryview], i: int, written: int) -> int:
    """After a write of ``written`` bytes from ``views[i:]``: the index of the first view not
    written whole, that view trimmed to what is left of it."""
    while written:
        size = len(views[i])
        if written >= size:
            written -= size
            i += 1
        else:
            views[i] = views[i][written:]
            written = 0
    return i
