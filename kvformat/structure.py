"""The parsed structure of one `.kv` file: header, footer, chunk table, manifest and snapshot
chain, checked against every rule of ``spec/SPEC.md`` section 8 before a size field is trusted;
and chunk access (payload, CRC, decode) by table index."""

from __future__ import annotations

import numpy as np

from kvformat import codecs, dtypes
from kvformat.checksum import crc32c, crc32c_many
from kvformat.codecs import BytesLike
from kvformat.errors import (
    ChecksumError,
    CorruptFileError,
    ForeignFormatError,
    InvalidArgumentError,
    KVFormatError,
    LimitExceededError,
    TruncatedFileError,
)
from kvformat.io.source import Source
from kvformat.layout import (
    ALIGN,
    DESCRIPTOR_DTYPE,
    DESCRIPTOR_SIZE,
    FOOTER_SIZE,
    HEADER_SIZE,
    KIND_ARRAY,
    KIND_Q,
    KIND_SELECTION,
    MAGIC,
    MAX_CHUNK_COUNT,
    MAX_JSON_SIZE,
    TENSOR_NAMES,
    Descriptor,
    Footer,
    check_header,
)
from kvformat.manifest import Manifest, loads, parse_manifest
from kvformat.quantization import Parts, Quantization
from kvformat.series import APPEND_CHUNKS, Chain, Entry, parse_entry
from kvformat.table_rules import check_table


def chunk_label(table: np.ndarray, i: int) -> str:
    rec = table[i]
    first = int(rec["position"])
    return (
        f"chunk {i} (layer {int(rec['layer'])}, head {int(rec['head'])}, seq {int(rec['seq'])}, "
        f"{TENSOR_NAMES.get(int(rec['kind']), '?')}, positions {first}..{first + int(rec['rows']) - 1})"
    )


def _checked_header(name: str, header: bytes, size: int) -> tuple[int, int]:
    """SPEC 13.1 step 1 (R1, R2): a file of a format kvsnap imports named as such (by its magic:
    `kvformat.importers.by_magic`); the magic where the file has it, then the size, then the
    header's own checks. Returns ``(major, minor)``."""
    if header[: len(MAGIC)] != MAGIC:
        from kvformat.importers.registry import by_magic  # the importers load only for such a file

        importer = by_magic(header)
        if importer is not None:
            raise ForeignFormatError(
                f"{name} is a {importer.what(header)}, not a kvsnap .kv file; convert it with "
                f"'kvsnap import {name} OUT.kv'"
            )
    if size < HEADER_SIZE + FOOTER_SIZE:
        if size >= len(MAGIC) and header[: len(MAGIC)] != MAGIC:
            raise CorruptFileError(f"{name}: not a .kv file (magic {header[:8]!r})")
        raise TruncatedFileError(f"{name}: {size} bytes is too short for a .kv file")
    return check_header(header)


def _checked_footer(source: Source, version: tuple[int, int]) -> Footer:
    """SPEC 13.1 step 2 (R3): the footer, its version equal to the header's."""
    try:
        footer = Footer.unpack(bytes(source.read(source.size - FOOTER_SIZE, FOOTER_SIZE)))
    except CorruptFileError as exc:
        hint = " (the writer did not finish: try 'kvsnap recover')"
        raise TruncatedFileError(f"{source.name}: {exc}{hint}") from None
    if footer.minor != version[1]:
        raise CorruptFileError(
            f"{source.name}: footer says version 1.{footer.minor}, the header 1.{version[1]}"
        )
    return footer


class FileStructure:
    """Parsed structure of one file: header, footer, chunk table, manifest, snapshot list."""

    def __init__(self, source: Source, check_checksums: bool) -> None:
        self.source = source
        self.check_checksums = check_checksums
        size = source.size
        header = bytes(source.read(0, min(size, HEADER_SIZE)))  # one read, whatever the size
        self.version = _checked_header(source.name, header, size)
        self.footer = f = _checked_footer(source, self.version)
        _check_index_place(source.name, f, size)
        table_size = f.chunk_count * DESCRIPTOR_SIZE
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
        _check_appends_declared(self.entries, self.manifest)
        self.chain = Chain(self.entries, self.table)
        self.checked_selections: set[int] = set()  # selection chunks whose rows were checked (1.7)

    def chunk(self, i: int) -> Descriptor:
        """The descriptor of table chunk ``i`` (a couple of microseconds: nothing per chunk is
        built at open, so a table of 300k chunks opens in milliseconds)."""
        return Descriptor.from_fields(self.table[i].item())

    def prefetch(self, chunks: list[int]) -> None:
        """Announce chunks about to be read (remote sources fetch them in few requests)."""
        if not getattr(self.source, "prefetches", True):
            return
        table = self.table[chunks]
        starts = (table["offset"].astype(np.int64) + DESCRIPTOR_SIZE).tolist()
        self.source.prefetch(list(zip(starts, table["stored_size"].tolist(), strict=True)))

    def read_payload(self, i: int, info: Descriptor | None = None, checked: bool = False) -> memoryview:
        """Stored bytes of chunk ``i``, CRC-checked if the file was opened with checks on."""
        c = self.chunk(i) if info is None else info
        payload = self.source.read(c.offset + DESCRIPTOR_SIZE, c.stored_size)
        if self.check_checksums and not checked and crc32c(payload) != c.payload_crc:
            raise self.payload_crc_error(i)
        return payload

    def chunk_name(self, i: int) -> str:
        """The file and chunk ``i`` as error messages name them."""
        return f"{self.source.name}: {chunk_label(self.table, i)}"

    def payload_crc_error(self, i: int) -> ChecksumError:
        """The error for chunk ``i``'s payload not matching its CRC-32C."""
        return payload_crc_mismatch(self.chunk_name(i))

    def _decoded(self, i: int, c: Descriptor, checked: bool = False) -> BytesLike:
        dtype = dtypes.from_code(c.dtype)
        payload = self.read_payload(i, c, checked)
        try:
            return codecs.from_code(c.codec).decode(payload, c.decoded_size, dtype.itemsize)
        except KVFormatError as exc:
            raise type(exc)(f"{self.chunk_name(i)}: {exc}") from None

    def _quantization(self, c: Descriptor) -> Quantization | None:
        if c.kind in (KIND_ARRAY, KIND_Q, KIND_SELECTION):  # stored plain, whatever the layer's K/V
            return None
        return self.manifest.layers[c.layer].quantization

    def chunk_parts(self, i: int) -> Parts:
        """(packed, scales, biases) of a chunk of a quantized layer, each ``(rows, ...)``."""
        c = self.chunk(i)
        quant = self._quantization(c)
        if quant is None:
            raise InvalidArgumentError(f"chunk {i} is not quantized")
        return self._parts(i, c, quant)

    def _parts(self, i: int, c: Descriptor, quant: Quantization, checked: bool = False) -> Parts:
        rows = np.frombuffer(self._decoded(i, c, checked), dtype=np.uint8).reshape(c.rows, -1)
        return quant.split(rows, c.width, dtypes.from_code(c.dtype).numpy)

    def chunk_rows(self, chunks: list[int], starts: list[int], counts: list[int]) -> np.ndarray | None:
        """Rows ``starts[j] .. starts[j] + counts[j] - 1`` of chunk ``chunks[j]`` for every j,
        concatenated: ``(sum(counts), width)`` (one copy, read-only), each payload CRC-checked if the file
        was opened with checks (one C call per chunk, nothing else per chunk in Python beyond a
        slice). For raw, unquantized tensor chunks of one dtype and width; None otherwise (read
        them one by one with `chunk_array`)."""
        table = self.table[chunks]
        first = table[0]
        if not self._plain_rows(table):
            return None
        dtype = dtypes.from_code(int(first["dtype"])).numpy
        width = int(first["width"])
        row_bytes = width * dtype.itemsize
        stored = table["stored_size"].tolist()
        if stored != (table["rows"].astype(np.int64) * row_bytes).tolist():
            return None  # sizes that do not match: `chunk_array` names the problem
        read = self.source.read
        places = zip(table["offset"].tolist(), stored, strict=True)
        payloads = [read(offset + DESCRIPTOR_SIZE, size) for offset, size in places]
        if self.check_checksums:
            bad = np.flatnonzero(crc32c_many(payloads) != table["payload_crc"])
            if bad.size:
                raise self.payload_crc_error(chunks[int(bad[0])])
        pieces = [
            payload[start * row_bytes : (start + count) * row_bytes]
            for payload, start, count in zip(payloads, starts, counts, strict=True)
        ]
        return np.frombuffer(b"".join(pieces), dtype).reshape(-1, width)  # read-only, like a map

    def _plain_rows(self, table: np.ndarray) -> bool:
        """The chunks of ``table`` are raw, unquantized tensor chunks of one dtype and width."""
        first = table[0]
        same = bool(np.all(table["dtype"] == first["dtype"])) and bool(
            np.all(table["width"] == first["width"])
        )
        if (
            not same
            or not bool(np.all(table["codec"] == codecs.Raw.code))
            or bool(np.any(table["kind"] == KIND_ARRAY))
        ):
            return False
        return all(self.manifest.layers[layer].quantization is None for layer in set(table["layer"].tolist()))

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


def payload_crc_mismatch(name: str) -> ChecksumError:
    """The error for the payload of the chunk named ``name`` not matching its CRC-32C."""
    return ChecksumError(f"{name}: payload CRC-32C mismatch")


def check_arrays(file: FileStructure, index: int, arrays: dict[str, int]) -> None:
    for name, chunk in arrays.items():
        if chunk >= len(file.table) or int(file.table["kind"][chunk]) != KIND_ARRAY:
            raise CorruptFileError(f"snapshot {index}: array {name!r} names chunk {chunk}, not an array")


def _check_index_place(name: str, footer: Footer, size: int) -> None:
    """The footer's counts within the limits, and its index 64-aligned, after the header and
    ending where the footer begins (SPEC 13.1, in that order)."""
    if footer.chunk_count > MAX_CHUNK_COUNT:
        raise LimitExceededError(f"chunk count {footer.chunk_count} exceeds {MAX_CHUNK_COUNT}")
    if footer.json_size > MAX_JSON_SIZE:
        raise LimitExceededError(f"index JSON of {footer.json_size} bytes exceeds {MAX_JSON_SIZE}")
    if footer.index_offset % ALIGN or footer.index_offset < HEADER_SIZE:
        raise CorruptFileError(f"index offset {footer.index_offset} is not a 64-aligned offset")
    if footer.index_offset + footer.chunk_count * DESCRIPTOR_SIZE + footer.json_size + FOOTER_SIZE != size:
        raise TruncatedFileError(
            f"{name}: footer places index at {footer.index_offset} with {footer.chunk_count} "
            f"chunks and {footer.json_size} JSON bytes, which does not end at file size {size}"
        )


def _check_appends_declared(entries: list[Entry], manifest: Manifest) -> None:
    """A snapshot that appends chunk ranges needs the ``append_chunks`` feature declared."""
    if APPEND_CHUNKS in manifest.required_features:
        return
    for i, entry in enumerate(entries):
        if entry.chunk_ranges.size:
            raise CorruptFileError(
                f"snapshot {i} uses 'append_chunks' but required_features does not list {APPEND_CHUNKS!r}"
            )
