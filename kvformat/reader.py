"""Reading `.kv` files: `open` parses header, footer and index only; K/V are read per head.

Raw chunks come back as zero-copy views of a memory map; compressed chunks are decoded on demand.
Every rule of ``spec/SPEC.md`` section 8 is checked before a size field is trusted.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from kvformat import codecs, dtypes, remote
from kvformat.checksum import crc32c
from kvformat.codecs import BytesLike
from kvformat.errors import (
    ChecksumError,
    CorruptFileError,
    KVFormatError,
    LimitExceededError,
    TruncatedFileError,
)
from kvformat.layout import (
    ALIGN,
    DESCRIPTOR_DTYPE,
    DESCRIPTOR_MAGIC,
    DESCRIPTOR_SIZE,
    FOOTER_SIZE,
    HEADER_SIZE,
    JSON_KINDS,
    KIND_ARRAY,
    KIND_K,
    KIND_MANIFEST,
    KIND_V,
    MAX_CHUNK_COUNT,
    MAX_CHUNK_DECODED,
    MAX_JSON_SIZE,
    MAX_POSITION,
    MAX_TOKENS_PER_CHUNK,
    MAX_WIDTH,
    MINOR,
    TABLE_KINDS,
    TENSOR_NAMES,
    Descriptor,
    Footer,
    align,
    check_header,
)
from kvformat.manifest import LayerSpec, Manifest, loads, parse_manifest
from kvformat.quantization import Parts, Quantization
from kvformat.remote import READ_AHEAD
from kvformat.series import Chain, Segment, parse_entry
from kvformat.source import FileObjectSource, MmapSource, Source


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
        if size < HEADER_SIZE + FOOTER_SIZE:
            if size >= 8:
                check_header(bytes(source.read(0, min(size, HEADER_SIZE))).ljust(HEADER_SIZE, b"\0"))
            raise TruncatedFileError(f"{source.name}: {size} bytes is too short for a .kv file")
        header = bytes(source.read(0, HEADER_SIZE))
        self.version = check_header(header)
        try:
            self.footer = Footer.unpack(bytes(source.read(size - FOOTER_SIZE, FOOTER_SIZE)))
        except CorruptFileError as exc:
            hint = " (the writer did not finish: try 'kvsnap recover')"
            raise TruncatedFileError(f"{source.name}: {exc}{hint}") from None
        f = self.footer
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
        self._check_table()
        layers, seqs = len(self.manifest.layers), self.manifest.num_seqs
        self.entries = [parse_entry(entry, i, layers, seqs) for i, entry in enumerate(snapshots)]
        self.chain = Chain(self.entries, self.table)
        # Python-int columns for fast per-chunk access.
        self.offsets = self.table["offset"].tolist()
        self.stored = self.table["stored_size"].tolist()
        self.decoded = self.table["decoded_size"].tolist()
        self.crcs = self.table["payload_crc"].tolist()
        self.rows = self.table["rows"].tolist()
        self.widths = self.table["width"].tolist()
        self.codecs = self.table["codec"].tolist()
        self.dtype_codes = self.table["dtype"].tolist()
        self.kinds = self.table["kind"].tolist()
        self.layers_of_chunks = self.table["layer"].tolist()

    def _check_table(self) -> None:
        """Vectorized checks of every chunk descriptor against the spec and the manifest."""
        t = self.table
        n = len(t)
        if n == 0:
            return
        index_offset = self.footer.index_offset
        if not bool(np.all(t["magic"] == DESCRIPTOR_MAGIC)):
            raise CorruptFileError("chunk table entry without descriptor magic")
        bad_kind = ~np.isin(t["kind"], TABLE_KINDS)
        if bad_kind.any():
            raise CorruptFileError(f"chunk table entry {int(np.argmax(bad_kind))} has an unknown kind")
        if t["flags"].any():
            raise CorruptFileError("chunk flags must be zero in version 1")
        offsets = t["offset"]
        stored = t["stored_size"]
        if bool(np.any(stored > index_offset)) or bool(np.any(offsets > index_offset)):
            raise CorruptFileError("chunk offset or size points past the index")
        if bool(np.any(offsets % ALIGN)) or int(offsets[0]) < HEADER_SIZE:
            raise CorruptFileError("chunk descriptor offset is not 64-aligned after the header")
        ends = offsets.astype(np.int64) + DESCRIPTOR_SIZE + stored.astype(np.int64)
        if n > 1 and bool(np.any(offsets[1:].astype(np.int64) < ends[:-1])):
            i = int(np.argmax(offsets[1:].astype(np.int64) < ends[:-1]))
            raise CorruptFileError(f"chunks {i} and {i + 1} overlap or are out of file order")
        if int(ends[-1]) > index_offset:
            raise CorruptFileError("last chunk runs into the index")
        rows = t["rows"].astype(np.int64)
        width = t["width"].astype(np.int64)
        if bool(np.any(rows > MAX_TOKENS_PER_CHUNK)) or bool(np.any(width > MAX_WIDTH)):
            raise LimitExceededError("chunk rows or width exceed the spec limits")
        position = t["position"]
        if bool(np.any(position < 0)) or bool(np.any(position + rows > MAX_POSITION)):
            raise CorruptFileError("chunk positions outside 0..2**53-1")
        for code in np.unique(t["codec"]).tolist():
            codecs.from_code(code)
        itemsize = np.zeros(n, dtype=np.int64)
        for code in np.unique(t["dtype"]).tolist():
            itemsize[t["dtype"] == code] = dtypes.from_code(code).itemsize
        decoded = t["decoded_size"]
        if bool(np.any(decoded > MAX_CHUNK_DECODED)):
            raise LimitExceededError(f"a chunk decodes to more than {MAX_CHUNK_DECODED} bytes")
        row_bytes = width * itemsize
        for layer_index, spec in enumerate(self.manifest.layers):
            if spec.present and spec.quantization is not None:
                for kind in (KIND_K, KIND_V):
                    mask = (t["layer"] == layer_index) & (t["kind"] == kind)
                    row_bytes[mask] = spec.row_bytes(kind)
        if not bool(np.all(rows * row_bytes == decoded.astype(np.int64))):
            raise CorruptFileError("chunk decoded size is not rows x (bytes per row)")
        raw = t["codec"] == codecs.Raw.code
        if not bool(np.all(stored[raw] == decoded[raw])):
            raise CorruptFileError("raw chunk stored size differs from its decoded size")
        arrays = t[t["kind"] == KIND_ARRAY]
        if bool(np.any(arrays["layer"])) or bool(np.any(arrays["head"])) or bool(np.any(arrays["seq"])):
            raise CorruptFileError("array chunk with a non-zero layer, head or seq")
        if bool(np.any(arrays["position"])):
            raise CorruptFileError("array chunk with a non-zero position")
        t = t[t["kind"] != KIND_ARRAY]
        layers = self.manifest.layers
        num_seqs = self.manifest.num_seqs
        if bool(np.any(t["layer"] >= len(layers))) or bool(np.any(t["seq"] >= num_seqs)):
            raise CorruptFileError("chunk names a layer or sequence the manifest does not declare")
        for layer_index in np.unique(t["layer"]).tolist():
            spec = layers[layer_index]
            mine = t[t["layer"] == layer_index]
            if not spec.present:
                raise CorruptFileError(f"chunk stored for absent layer {layer_index}")
            assert spec.dtype is not None
            dims = np.where(mine["kind"] == KIND_K, spec.k_dim, spec.v_dim)
            if (
                bool(np.any(mine["head"] >= spec.num_heads))
                or bool(np.any(mine["width"] != dims))
                or bool(np.any(mine["dtype"] != spec.dtype.code))
            ):
                raise CorruptFileError(
                    f"chunk of layer {layer_index} disagrees with the layer's heads, dims or dtype"
                )

    def prefetch(self, chunks: list[int]) -> None:
        """Announce chunks about to be read (remote sources fetch them in few requests)."""
        self.source.prefetch([(self.offsets[i] + DESCRIPTOR_SIZE, self.stored[i]) for i in chunks])

    def read_payload(self, i: int) -> memoryview:
        """Stored bytes of chunk ``i``, CRC-checked if the file was opened with checks on."""
        payload = self.source.read(self.offsets[i] + DESCRIPTOR_SIZE, self.stored[i])
        if self.check_checksums and crc32c(payload) != self.crcs[i]:
            raise ChecksumError(
                f"{self.source.name}: {_chunk_label(self.table, i)}: payload CRC-32C mismatch"
            )
        return payload

    def _decoded(self, i: int) -> BytesLike:
        dtype = dtypes.from_code(self.dtype_codes[i])
        payload = self.read_payload(i)
        try:
            return codecs.from_code(self.codecs[i]).decode(payload, self.decoded[i], dtype.itemsize)
        except KVFormatError as exc:
            raise type(exc)(f"{self.source.name}: {_chunk_label(self.table, i)}: {exc}") from None

    def _quantization(self, i: int) -> Quantization | None:
        if self.kinds[i] == KIND_ARRAY:
            return None
        return self.manifest.layers[self.layers_of_chunks[i]].quantization

    def chunk_parts(self, i: int) -> Parts:
        """(packed, scales, biases) of a chunk of a quantized layer, each ``(rows, ...)``."""
        quant = self._quantization(i)
        if quant is None:
            raise ValueError(f"chunk {i} is not quantized")
        rows = np.frombuffer(self._decoded(i), dtype=np.uint8).reshape(self.rows[i], -1)
        return quant.split(rows, self.widths[i], dtypes.from_code(self.dtype_codes[i]).numpy)

    def chunk_array(self, i: int) -> np.ndarray:
        """Chunk ``i`` decoded: ``(rows, width)`` (a zero-copy view for raw chunks from mmap);
        quantized chunks come back dequantized."""
        dtype = dtypes.from_code(self.dtype_codes[i])
        quant = self._quantization(i)
        if quant is not None:
            return quant.dequantize(self.chunk_parts(i), dtype.numpy)
        return np.frombuffer(self._decoded(i), dtype=dtype.numpy).reshape(self.rows[i], self.widths[i])


class Snapshot:
    """One snapshot of a `.kv` file (the last one unless another is selected).

    Use as a context manager. ``head(layer, head)`` returns a `Head` or ``None`` for an absent
    layer; ``blocks()`` streams every segment in file order; ``verify()`` checks every byte.
    """

    def __init__(self, file: _File, index: int) -> None:
        count = len(file.entries)
        if not isinstance(index, int) or not -count <= index < count:
            raise IndexError(f"snapshot {index} out of range: the file holds {count}")
        self._file = file
        self.index = index % count
        self._segments = file.chain.segments(self.index)
        entry = file.entries[self.index]
        self.snapshot_metadata: dict[str, Any] = entry.metadata
        for name, chunk in entry.arrays.items():
            if chunk >= len(file.table) or int(file.table["kind"][chunk]) != KIND_ARRAY:
                raise CorruptFileError(
                    f"snapshot {self.index}: array {name!r} names chunk {chunk}, not an array"
                )
        self._arrays = entry.arrays

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
        return max((segs[-1].position + segs[-1].count for segs in self._segments.values()), default=0)

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
        segments = self._segments.get((layer, seq, head), [])
        return _positions(segments)

    # -- data ------------------------------------------------------------------------------
    def _layer(self, layer: int, head: int, seq: int) -> LayerSpec | None:
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        if not isinstance(seq, int) or not 0 <= seq < self.num_seqs:
            raise IndexError(f"seq {seq} out of range 0..{self.num_seqs - 1}")
        spec = self.layers[layer]
        if not spec.present:
            return None
        if not isinstance(head, int) or not 0 <= head < spec.num_heads:
            raise IndexError(f"head {head} out of range 0..{spec.num_heads - 1} in layer {layer}")
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
        segments = self._segments.get((layer, seq, head), [])
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
        segments = self._segments.get((layer, seq, head), [])
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
        every = [seg for segs in self._segments.values() for seg in segs]
        return sorted(every, key=lambda seg: seg.k_chunk)

    def blocks(self) -> Iterator[Head]:
        """Stream the snapshot segment by segment in file order: a `Head` holding one run.

        Pages of a chunk are released from this process once the next block is requested, so a
        pass over a file larger than memory keeps a bounded resident set.
        """
        file = self._file
        segments = self.segments()
        announced = 0
        for i, seg in enumerate(segments):
            if i == announced:  # read-ahead for remote sources (a no-op on a memory map)
                budget, chunks = READ_AHEAD, list[int]()
                while announced < len(segments) and (budget > 0 or not chunks):
                    for chunk in (segments[announced].k_chunk, segments[announced].v_chunk):
                        chunks.append(chunk)
                        budget -= file.stored[chunk]
                    announced += 1
                file.prefetch(chunks)
            yield Head(
                seg.layer,
                seg.head,
                seg.seq,
                file.chunk_array(seg.k_chunk)[seg.k_row : seg.k_row + seg.count],
                file.chunk_array(seg.v_chunk)[seg.v_row : seg.v_row + seg.count],
                np.arange(seg.position, seg.position + seg.count, dtype=np.int64),
            )
            for chunk in (seg.k_chunk, seg.v_chunk):
                file.source.release(file.offsets[chunk], DESCRIPTOR_SIZE + file.stored[chunk])

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
            f"snapshot {self.index + 1}/{self.num_snapshots}: {self.num_layers} layers, "
            f"{self.num_heads} kv heads, head_dim {self.head_dim}, seq_len {self.seq_len}>"
        )


def _positions(segments: list[Segment]) -> np.ndarray:
    if not segments:
        return np.empty(0, np.int64)
    return np.concatenate([np.arange(s.position, s.position + s.count, dtype=np.int64) for s in segments])


def _token_range(tokens: tuple[int, int] | range | None) -> tuple[int, int]:
    if tokens is None:
        return 0, MAX_POSITION
    if isinstance(tokens, range):
        if tokens.step != 1:
            raise ValueError("tokens range must have step 1")
        return tokens.start, tokens.stop
    start, stop = tokens
    return int(start), int(stop)


def _verify(file: _File) -> VerifyReport:
    """Walk the record stream from offset 64 to the index, checking everything."""
    source = file.source
    index_offset = file.footer.index_offset
    cursor = HEADER_SIZE
    records = 0
    chunk = 0
    checked = 0
    while cursor < index_offset:
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
            file_checks = file.check_checksums
            file.check_checksums = False
            try:
                file.chunk_array(chunk)
            finally:
                file.check_checksums = file_checks
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
        checked += DESCRIPTOR_SIZE + desc.stored_size
        records += 1
        cursor = next_record
    if chunk != len(file.table):
        raise CorruptFileError(f"index lists {len(file.table)} chunks, the file holds {chunk}")
    for i in range(len(file.entries)):
        Snapshot(file, i)
    return VerifyReport(records, chunk, len(file.entries), checked)


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
