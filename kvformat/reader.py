"""Reading `.kv` files: `open` parses header, footer and index only; K/V are read per head.

Raw chunks come back as zero-copy views of a memory map; compressed chunks are decoded on demand.
Every rule of ``spec/SPEC.md`` section 8 is checked before a size field is trusted.
"""

from __future__ import annotations

import collections
import functools
import os
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from kvformat import codecs, dtypes, remote
from kvformat.checksum import crc32c, crc32c_rows, crc32c_slices
from kvformat.codecs import BytesLike
from kvformat.errors import (
    ChecksumError,
    CorruptFileError,
    ForeignFormatError,
    KVFormatError,
    LimitExceededError,
    OutOfRangeError,
    TruncatedFileError,
)
from kvformat.layout import (
    ALIGN,
    DESCRIPTOR_DTYPE,
    DESCRIPTOR_SIZE,
    FOOTER_SIZE,
    HEADER_SIZE,
    JSON_KINDS,
    KIND_ARRAY,
    KIND_MANIFEST,
    MAX_CHUNK_COUNT,
    MAX_JSON_SIZE,
    MAX_POSITION,
    MINOR,
    TABLE_KINDS,
    TENSOR_NAMES,
    Descriptor,
    Footer,
    align,
    check_header,
)
from kvformat.manifest import LayerSpec, Manifest, loads, parse_manifest
from kvformat.mlxkv import is_mlxkv
from kvformat.quantization import Parts, Quantization
from kvformat.remote import READ_AHEAD
from kvformat.series import APPEND_CHUNKS, Chain, Segment, Segments, parse_entry, ranges
from kvformat.source import FileObjectSource, MmapSource, Source
from kvformat.table_rules import check_table


@dataclass(frozen=True)
class Head:
    """K and V of one KV head of one layer for one sequence, in temporal order.

    ``k``: ``(n_tokens, k_dim)``, ``v``: ``(n_tokens, v_dim)`` in the layer's dtype (bfloat16 as
    ``ml_dtypes.bfloat16``); ``positions``: ``(n_tokens,)`` int64 absolute token positions.
    """

    layer: int
    head: int
    seq: int
    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray


@dataclass(frozen=True)
class VerifyReport:
    """What `Snapshot.verify` checked: records, tensor chunks, bytes covered by CRCs."""

    records: int
    chunks: int
    snapshots: int
    bytes_checked: int


def _chunk_label(table: np.ndarray, i: int) -> str:
    rec = table[i]
    first = int(rec["position"])
    return (
        f"chunk {i} (layer {int(rec['layer'])}, head {int(rec['head'])}, seq {int(rec['seq'])}, "
        f"{TENSOR_NAMES.get(int(rec['kind']), '?')}, positions {first}..{first + int(rec['rows']) - 1})"
    )


class _File:
    """Parsed structure of one file: header, footer, chunk table, manifest, snapshot list."""

    def __init__(self, source: Source, check_checksums: bool) -> None:
        self.source = source
        self.check_checksums = check_checksums
        size = source.size
        header = bytes(source.read(0, min(size, HEADER_SIZE)))  # one read, whatever the size
        if is_mlxkv(header):
            raise ForeignFormatError(
                f"{source.name} is a go-mlx MLXKV001 snapshot, not a kvsnap .kv file; convert it with "
                f"'kvsnap import-mlxkv {source.name} OUT.kv'"
            )
        if size < HEADER_SIZE + FOOTER_SIZE:
            if size >= 8:
                check_header(header.ljust(HEADER_SIZE, b"\0"))
            raise TruncatedFileError(f"{source.name}: {size} bytes is too short for a .kv file")
        self.version = check_header(header)
        try:
            self.footer = Footer.unpack(bytes(source.read(size - FOOTER_SIZE, FOOTER_SIZE)))
        except CorruptFileError as exc:
            hint = " (the writer did not finish: try 'kvsnap recover')"
            raise TruncatedFileError(f"{source.name}: {exc}{hint}") from None
        f = self.footer
        if f.minor != self.version[1]:
            raise CorruptFileError(
                f"{source.name}: footer says version 1.{f.minor}, the header 1.{self.version[1]}"
            )
        if f.chunk_count > MAX_CHUNK_COUNT:
            raise LimitExceededError(f"chunk count {f.chunk_count} exceeds {MAX_CHUNK_COUNT}")
        if f.json_size > MAX_JSON_SIZE:
            raise LimitExceededError(f"index JSON of {f.json_size} bytes exceeds {MAX_JSON_SIZE}")
        if f.index_offset % ALIGN or f.index_offset < HEADER_SIZE:
            raise CorruptFileError(f"index offset {f.index_offset} is not a 64-aligned offset")
        table_size = f.chunk_count * DESCRIPTOR_SIZE
        if f.index_offset + table_size + f.json_size + FOOTER_SIZE != size:
            raise TruncatedFileError(
                f"{source.name}: footer places index at {f.index_offset} with {f.chunk_count} "
                f"chunks and {f.json_size} JSON bytes, which does not end at file size {size}"
            )
        index = source.read(f.index_offset, table_size + f.json_size)
        if crc32c(index, crc32c(header)) != f.index_crc:
            raise ChecksumError(f"{source.name}: CRC-32C over header and index does not match")
        self.table = np.frombuffer(index[:table_size], dtype=DESCRIPTOR_DTYPE)
        document = loads(index[table_size:], "index JSON")
        if not isinstance(document, dict):
            raise CorruptFileError("index JSON must be an object")
        self.manifest: Manifest = parse_manifest(document.get("manifest"))
        snapshots = document.get("snapshots")
        if not isinstance(snapshots, list) or not snapshots:
            raise CorruptFileError("index JSON must list at least one snapshot")
        check_table(self.table, self.footer.index_offset, self.manifest)
        layers, seqs = len(self.manifest.layers), self.manifest.num_seqs
        self.entries = [parse_entry(entry, i, layers, seqs) for i, entry in enumerate(snapshots)]
        if APPEND_CHUNKS not in self.manifest.required_features:
            for i, entry in enumerate(self.entries):
                if entry.chunk_ranges.size:
                    raise CorruptFileError(
                        f"snapshot {i} uses 'append_chunks' but required_features does not list "
                        f"{APPEND_CHUNKS!r}"
                    )
        self.chain = Chain(self.entries, self.table)

    def chunk(self, i: int) -> Descriptor:
        """The descriptor of table chunk ``i`` (a couple of microseconds: nothing per chunk is
        built at open, so a table of 300k chunks opens in milliseconds)."""
        return Descriptor.from_fields(self.table[i].item())

    def prefetch(self, chunks: list[int]) -> None:
        """Announce chunks about to be read (remote sources fetch them in few requests)."""
        infos = [self.chunk(i) for i in chunks]
        self.source.prefetch([(c.offset + DESCRIPTOR_SIZE, c.stored_size) for c in infos])

    def read_payload(self, i: int, info: Descriptor | None = None, checked: bool = False) -> memoryview:
        """Stored bytes of chunk ``i``, CRC-checked if the file was opened with checks on."""
        c = self.chunk(i) if info is None else info
        payload = self.source.read(c.offset + DESCRIPTOR_SIZE, c.stored_size)
        if self.check_checksums and not checked and crc32c(payload) != c.payload_crc:
            raise ChecksumError(
                f"{self.source.name}: {_chunk_label(self.table, i)}: payload CRC-32C mismatch"
            )
        return payload

    def _decoded(self, i: int, c: Descriptor, checked: bool = False) -> BytesLike:
        dtype = dtypes.from_code(c.dtype)
        payload = self.read_payload(i, c, checked)
        try:
            return codecs.from_code(c.codec).decode(payload, c.decoded_size, dtype.itemsize)
        except KVFormatError as exc:
            raise type(exc)(f"{self.source.name}: {_chunk_label(self.table, i)}: {exc}") from None

    def _quantization(self, c: Descriptor) -> Quantization | None:
        if c.kind == KIND_ARRAY:
            return None
        return self.manifest.layers[c.layer].quantization

    def chunk_parts(self, i: int) -> Parts:
        """(packed, scales, biases) of a chunk of a quantized layer, each ``(rows, ...)``."""
        c = self.chunk(i)
        quant = self._quantization(c)
        if quant is None:
            raise ValueError(f"chunk {i} is not quantized")
        return self._parts(i, c, quant)

    def _parts(self, i: int, c: Descriptor, quant: Quantization, checked: bool = False) -> Parts:
        rows = np.frombuffer(self._decoded(i, c, checked), dtype=np.uint8).reshape(c.rows, -1)
        return quant.split(rows, c.width, dtypes.from_code(c.dtype).numpy)

    def chunk_array(self, i: int, checked: bool = False) -> np.ndarray:
        """Chunk ``i`` decoded: ``(rows, width)`` (a zero-copy view for raw chunks from mmap);
        quantized chunks come back dequantized. ``checked``: its CRC was just verified (by
        `verify`), so it is not computed again."""
        c = self.chunk(i)
        dtype = dtypes.from_code(c.dtype)
        quant = self._quantization(c)
        if quant is not None:
            return quant.dequantize(self._parts(i, c, quant, checked), dtype.numpy)
        return np.frombuffer(self._decoded(i, c, checked), dtype=dtype.numpy).reshape(c.rows, c.width)


class Snapshot:
    """One snapshot of a `.kv` file (the last one unless another is selected).

    Use as a context manager. ``head(layer, head)`` returns a `Head` or ``None`` for an absent
    layer; ``blocks()`` streams every segment in file order; ``verify()`` checks every byte.
    """

    def __init__(self, file: _File, index: int) -> None:
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
        _check_arrays(file, self.index, entry.arrays)
        self._arrays = entry.arrays

    @functools.cached_property
    def _segments(self) -> Segments:
        """This snapshot materialized and checked (SPEC R13-R14), on first use: opening a long
        series or selecting a snapshot builds nothing until data or structure is asked for."""
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

    @property
    def num_chunks(self) -> int:
        return len(self._file.table)

    @property
    def array_names(self) -> list[str]:
        """Names of the arrays attached to this snapshot (e.g. ``"last_logits"``)."""
        return sorted(self._arrays)

    def array(self, name: str) -> np.ndarray | None:
        """An array attached to this snapshot, ``(rows, width)``, or None if there is none."""
        chunk = self._arrays.get(name)
        return None if chunk is None else self._file.chunk_array(chunk)

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
        self, layer: int, head: int, seq: int = 0, tokens: tuple[int, int] | range | None = None
    ) -> Head | None:
        """K, V and positions of one head, or ``None`` if ``layer`` is absent from the file.

        ``tokens=(start, stop)`` keeps absolute positions ``start <= p < stop``. A single raw
        chunk comes back as a zero-copy read-only view; anything else is one new array.
        """
        spec = self._layer(layer, head, seq)
        if spec is None:
            return None
        assert spec.dtype is not None
        segments = self._segments.of_head(layer, seq, head)
        start, stop = _token_range(tokens)
        wanted = [s for s in segments if max(start, s.position) < min(stop, s.position + s.count)]
        self._file.prefetch([c for s in wanted for c in (s.k_chunk, s.v_chunk)])
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
            v_parts.append(self._file.chunk_array(seg.v_chunk)[seg.v_row + skip :][:n])
            pos_parts.append(np.arange(first, last, dtype=np.int64))
        if not k_parts:
            empty = spec.dtype.numpy
            return Head(
                layer,
                head,
                seq,
                np.empty((0, spec.k_dim), empty),
                np.empty((0, spec.v_dim), empty),
                np.empty(0, np.int64),
            )
        if len(k_parts) == 1:
            return Head(layer, head, seq, k_parts[0], v_parts[0], pos_parts[0])
        return Head(
            layer, head, seq, np.concatenate(k_parts), np.concatenate(v_parts), np.concatenate(pos_parts)
        )

    def quantized_head(self, layer: int, head: int, seq: int = 0) -> tuple[Parts, Parts, np.ndarray] | None:
        """K and V of a quantized layer as stored: ``(packed, scales, biases)`` each, plus
        positions; None for an absent layer. Raises ValueError for an unquantized layer."""
        spec = self._layer(layer, head, seq)
        if spec is None:
            return None
        if spec.quantization is None:
            raise ValueError(f"layer {layer} is not quantized")
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
        """All segments of this snapshot in file order of their K chunk."""
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
            raise ValueError(f"hold must be a non-negative integer, not {hold!r}")
        holding = hold if callable(hold) else (lambda: hold)
        file = self._file
        segments = self.segments()
        announced = 0
        held: collections.deque[Segment] = collections.deque()
        for i, seg in enumerate(segments):
            if i == announced:  # read-ahead for remote sources (a no-op on a memory map)
                budget, ahead = READ_AHEAD, list[Segment]()
                while announced < len(segments) and (budget > 0 or not ahead):
                    ahead.append(segments[announced])
                    budget -= (
                        file.chunk(segments[announced].k_chunk).stored_size
                        + file.chunk(segments[announced].v_chunk).stored_size
                    )
                    announced += 1
                self.prefetch(ahead)
            yield self.read(seg)
            held.append(seg)
            keep = holding()
            while len(held) > keep:
                self.release(held.popleft())

    def read(self, segment: Segment) -> Head:
        """One segment of `segments()` as a `Head`: its K and V rows decoded (CRC-checked when
        the file was opened with checks; a view of the map for raw chunks), its positions.
        Thread-safe: a pass may read segments on several threads."""
        file = self._file
        return Head(
            segment.layer,
            segment.head,
            segment.seq,
            file.chunk_array(segment.k_chunk)[segment.k_row : segment.k_row + segment.count],
            file.chunk_array(segment.v_chunk)[segment.v_row : segment.v_row + segment.count],
            np.arange(segment.position, segment.position + segment.count, dtype=np.int64),
        )

    def release(self, segment: Segment) -> None:
        """Drop the pages of the segment's chunks from this process (views stay valid: the pages
        fault back in), so a streaming pass keeps a bounded resident set."""
        file = self._file
        for chunk in (segment.k_chunk, segment.v_chunk):
            c = file.chunk(chunk)
            file.source.release(c.offset, DESCRIPTOR_SIZE + c.stored_size)

    def prefetch(self, segments: list[Segment]) -> None:
        """Announce segments about to be read: a remote source fetches them in few requests (a
        no-op on a memory map)."""
        self._file.prefetch([chunk for seg in segments for chunk in (seg.k_chunk, seg.v_chunk)])

    def check_snapshots(self) -> None:
        """Check that every snapshot of the file materializes (section 11), each entry once."""
        self._file.chain.check_all()
        for i, entry in enumerate(self._file.entries):
            _check_arrays(self._file, i, entry.arrays)

    def verify(self) -> VerifyReport:
        """Check every CRC, every record, padding, the index copy and every snapshot.

        Raises the first problem found as a `KVFormatError` naming the chunk (layer, head, K/V,
        positions); returns a `VerifyReport` when the whole file is sound.
        """
        return _verify(self._file)

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


def _check_arrays(file: _File, index: int, arrays: dict[str, int]) -> None:
    for name, chunk in arrays.items():
        if chunk >= len(file.table) or int(file.table["kind"][chunk]) != KIND_ARRAY:
            raise CorruptFileError(f"snapshot {index}: array {name!r} names chunk {chunk}, not an array")


def _positions(segments: list[Segment]) -> np.ndarray:
    return ranges(
        np.array([s.position for s in segments], np.int64), np.array([s.count for s in segments], np.int64)
    )


def _token_range(tokens: tuple[int, int] | range | None) -> tuple[int, int]:
    if tokens is None:
        return 0, MAX_POSITION
    if isinstance(tokens, range):
        if tokens.step != 1:
            raise ValueError("tokens range must have step 1")
        return tokens.start, tokens.stop
    start, stop = tokens
    return int(start), int(stop)


_VERIFY_BATCH_BYTES = 64 << 20  # records checked together in bulk: at most this many bytes


def _verify(file: _File) -> VerifyReport:
    """Walk the record stream from offset 64 to the index, checking everything.

    Runs of table chunks laid back to back are checked in bulk (`_verify_chunks`: descriptors
    against the chunk table, descriptor and payload CRCs, padding), the JSON records between them
    one by one (`_verify_record`); whatever fails in bulk is checked again one by one, so the
    error names the record exactly as the one-by-one walk would."""
    index_offset = file.footer.index_offset
    table = file.table
    n = len(table)
    offsets = table["offset"].astype(np.int64)
    follows = (
        (offsets + DESCRIPTOR_SIZE + table["stored_size"].astype(np.int64) + (ALIGN - 1)) // ALIGN * ALIGN
    )
    # Chunk i+1 starts where chunk i's record ends: runs of back-to-back chunks end at the breaks.
    breaks = np.flatnonzero(follows[:-1] != offsets[1:]) if n > 1 else np.empty(0, np.int64)
    cursor, records, chunk, checked = HEADER_SIZE, 0, 0, 0
    while cursor < index_offset:
        if records and chunk < n and int(offsets[chunk]) == cursor:
            last = (
                int(breaks[np.searchsorted(breaks, chunk)]) if breaks.size and breaks[-1] >= chunk else n - 1
            )
            while chunk <= last:  # in batches of bounded size
                stop = int(np.searchsorted(offsets, offsets[chunk] + _VERIFY_BATCH_BYTES, side="left"))
                stop = min(max(stop, chunk + 1), last + 1)
                size, end = _verify_chunks(file, chunk, stop, int(follows[stop - 1]))
                if end < 0:  # something is wrong in this batch: walk it one by one for the error
                    for _ in range(chunk, stop):
                        cursor, chunk, size = _verify_record(file, cursor, records, chunk)
                        checked += size
                        records += 1
                    raise AssertionError("a batch failed in bulk but passed record by record")
                checked += size
                records += stop - chunk
                chunk, cursor = stop, end
            continue
        cursor, chunk, size = _verify_record(file, cursor, records, chunk)
        checked += size
        records += 1
    if chunk != n:
        raise CorruptFileError(f"index lists {n} chunks, the file holds {chunk}")
    file.chain.check_all()  # every snapshot, each entry once
    for i, entry in enumerate(file.entries):
        _check_arrays(file, i, entry.arrays)
    return VerifyReport(records, chunk, len(file.entries), checked)


def _verify_chunks(file: _File, first: int, stop: int, follows: int) -> tuple[int, int]:
    """Check table chunks ``first .. stop-1``, laid back to back, in bulk. Returns the bytes of
    their records and the offset after the last one's padding, or ``(0, -1)`` if any check fails."""
    table = file.table[first:stop]
    index_offset = file.footer.index_offset
    base = int(table["offset"][0])
    end = min(follows, index_offset)
    span = np.frombuffer(file.source.read(base, end - base), dtype=np.uint8)
    starts = table["offset"].astype(np.int64) - base
    stride = int(starts[1]) if len(starts) > 1 else DESCRIPTOR_SIZE
    if bool(np.all(starts == np.arange(len(starts)) * stride)):  # equal records: a strided view
        descriptors = np.ndarray((len(starts), DESCRIPTOR_SIZE), np.uint8, buffer=span, strides=(stride, 1))
    else:
        descriptors = span[starts[:, None] + np.arange(DESCRIPTOR_SIZE)]
    if not np.array_equal(descriptors, table.view(np.uint8).reshape(-1, DESCRIPTOR_SIZE)):
        return 0, -1
    if not np.array_equal(crc32c_rows(np.ascontiguousarray(descriptors[:, :60])), table["descriptor_crc"]):
        return 0, -1
    stored = table["stored_size"].astype(np.int64)
    crcs = crc32c_slices(span.data, (starts + DESCRIPTOR_SIZE).tolist(), stored.tolist())
    if not np.array_equal(crcs, table["payload_crc"]):
        return 0, -1
    # Padding: from each payload's end to the next record (or the index), all zero.
    ends = starts + DESCRIPTOR_SIZE + stored
    nexts = np.append(starts[1:], end - base)
    lengths = nexts - ends
    if lengths.sum():
        where = np.repeat(ends - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        if span[where].any():
            return 0, -1
    encoded = np.flatnonzero(table["codec"] != codecs.Raw.code)
    if encoded.size:  # decoding is the check of an encoded payload (raw ones are sized already)
        try:
            for i in encoded.tolist():
                file.chunk_array(first + i, checked=True)
        except KVFormatError:
            return 0, -1
    return int((DESCRIPTOR_SIZE + stored).sum()), end


def _verify_record(file: _File, cursor: int, records: int, chunk: int) -> tuple[int, int, int]:
    """Check the one record at ``cursor`` (the ``records``-th; ``chunk`` table chunks before it).
    Returns the next record's offset, the chunks seen, and this record's bytes."""
    source = file.source
    index_offset = file.footer.index_offset
    if cursor + DESCRIPTOR_SIZE > index_offset:
        raise CorruptFileError(f"record at {cursor} overruns the index")
    raw = source.read(cursor, DESCRIPTOR_SIZE)
    try:
        desc = Descriptor.unpack(raw)
    except KVFormatError as exc:
        raise type(exc)(f"{source.name}: record at offset {cursor}: {exc}") from None
    if desc.offset != cursor:
        raise CorruptFileError(f"record at {cursor} says it lies at {desc.offset}")
    if desc.end > index_offset:
        raise CorruptFileError(f"record at {cursor} runs into the index")
    payload = source.read(desc.payload_offset, desc.stored_size)
    label = f"record at offset {cursor}"
    if desc.kind in TABLE_KINDS:
        if chunk >= len(file.table) or bytes(raw) != file.table[chunk].tobytes():
            raise CorruptFileError(f"{label}: chunk {chunk} differs from its index copy")
        label = _chunk_label(file.table, chunk)
    if crc32c(payload) != desc.payload_crc:
        raise ChecksumError(f"{source.name}: {label}: payload CRC-32C mismatch")
    if desc.kind in TABLE_KINDS:
        file.chunk_array(chunk, checked=True)
        chunk += 1
    elif desc.kind in JSON_KINDS:
        loads(payload, label)
    elif file.version[1] <= MINOR:
        raise CorruptFileError(f"{label}: unknown record kind {desc.kind}")
    if (records == 0) != (desc.kind == KIND_MANIFEST):
        raise CorruptFileError(f"{label}: the manifest must be the first record, and only it")
    next_record = align(desc.end)
    padding = source.read(desc.end, min(next_record, index_offset) - desc.end)
    if any(padding):
        raise CorruptFileError(f"{label}: non-zero padding after the payload")
    return next_record, chunk, DESCRIPTOR_SIZE + desc.stored_size


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
    source: Source
    if filesystem is not None or remote.is_url(file):
        assert isinstance(file, str | os.PathLike)
        location = os.fspath(file)
        if filesystem is None and location.startswith("file://"):
            source = MmapSource(urllib.parse.unquote(urllib.parse.urlsplit(location).path))
        else:
            reader = remote.range_reader(
                location, filesystem=filesystem, storage_options=storage_options, timeout=timeout
            )
            try:
                source = remote.RemoteSource(reader)
            except BaseException:
                reader.close()
                raise
    elif isinstance(file, str | os.PathLike):
        source = MmapSource(file)
    else:
        source = FileObjectSource(file)
    try:
        return Snapshot(_File(source, check_checksums), snapshot)
    except BaseException:
        source.close()
        raise
