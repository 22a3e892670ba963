"""The fixed binary structures of a `.kv` file: header, chunk descriptor and footer.

All integers are little-endian. See ``spec/SPEC.md`` sections 3-6 for the normative text;
this module is the executable form of those tables.

File layout::

    offset 0        header               64 bytes
    offset 64       records              each: 64-byte descriptor, payload, zero padding to 64
    index_offset    chunk table          chunk_count x 64-byte descriptors (copies)
                    index JSON           json_size bytes of UTF-8
    file_size - 64  footer               64 bytes
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat import sniff
from kvformat.checksum import crc32c
from kvformat.errors import ChecksumError, CorruptFileError, UnsupportedVersionError

MAGIC = sniff.KV
FOOTER_MAGIC = b"KVSINDEX"
DESCRIPTOR_MAGIC = b"KVCK"
MAJOR = 1
MINOR = 8  # what this reader implements; written: 2, 3 with queries, 7 with selections, 8 pooled keys
LAST_STRICT_MINOR = 6  # up to 1.6 every unknown record kind is corrupt; from 1.7, features define kinds (5.2)
ALIGN = 64
HEADER_SIZE = 64
DESCRIPTOR_SIZE = 64
FOOTER_SIZE = 64

# Record kinds (descriptor byte 4).
KIND_K = 0
KIND_V = 1
KIND_ARRAY = 2
KIND_Q = 3  # format 1.3: queries (feature "queries")
KIND_SELECTION = 4  # format 1.7: sparse attention's key selections (feature "sparse-attention")
KIND_MANIFEST = 16
KIND_SNAPSHOT = 17
TENSOR_KINDS = (KIND_K, KIND_V)
TABLE_KINDS = (KIND_K, KIND_V, KIND_ARRAY, KIND_Q, KIND_SELECTION)
JSON_KINDS = (KIND_MANIFEST, KIND_SNAPSHOT)
TENSOR_NAMES = {KIND_K: "k", KIND_V: "v", KIND_ARRAY: "array", KIND_Q: "q", KIND_SELECTION: "selection"}

# Hard limits a reader applies before trusting any size field (spec section 8).
MAX_JSON_SIZE = 256 * 1024 * 1024
MAX_CHUNK_COUNT = 1 << 28
MAX_CHUNK_DECODED = 1 << 31
MAX_TOKENS_PER_CHUNK = 1 << 31
MAX_WIDTH = 1 << 20
MAX_LAYERS = 1 << 16
MAX_HEADS = 1 << 16
MAX_SEQS = 1 << 20
MAX_HEAD_SEQUENCES = 1 << 24  # sum of num_heads over present layers, times num_seqs
MAX_POSITION = 1 << 53

_HEADER = struct.Struct("<8sHHI44sI")
_FOOTER = struct.Struct("<8sQQQIHH20sI")

DESCRIPTOR_FIELDS = (
    ("magic", "S4"),
    ("kind", "u1"),
    ("dtype", "u1"),
    ("codec", "u1"),
    ("flags", "u1"),
    ("layer", "<u2"),
    ("head", "<u2"),
    ("seq", "<u4"),
    ("position", "<i8"),
    ("rows", "<u4"),
    ("width", "<u4"),
    ("offset", "<u8"),
    ("stored_size", "<u8"),
    ("decoded_size", "<u8"),
    ("payload_crc", "<u4"),
    ("descriptor_crc", "<u4"),
)
"""The 64-byte record descriptor (SPEC section 5), field by field, little-endian: declared here
once; the numpy record type, the struct format and `Descriptor` are derived from it."""
DESCRIPTOR_DTYPE = np.dtype(list(DESCRIPTOR_FIELDS))
_STRUCT_CODES = {"S4": "4s", "u1": "B", "<u2": "H", "<u4": "I", "<i8": "q", "<u8": "Q"}
_DESCRIPTOR = struct.Struct("<" + "".join(_STRUCT_CODES[code] for _, code in DESCRIPTOR_FIELDS))
_VALUES = tuple(name for name, _ in DESCRIPTOR_FIELDS[1:-1])  # what `Descriptor` holds, in order
assert DESCRIPTOR_DTYPE.itemsize == DESCRIPTOR_SIZE == _DESCRIPTOR.size
assert _HEADER.size == HEADER_SIZE and _FOOTER.size == FOOTER_SIZE


def align(offset: int) -> int:
    """Round ``offset`` up to the next multiple of 64."""
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def pack_header(minor: int = MINOR) -> bytes:
    """The 64-byte header: magic, major, minor, header size, reserved zeros, CRC-32C."""
    body = _HEADER.pack(MAGIC, MAJOR, minor, HEADER_SIZE, b"", 0)[:60]
    return body + struct.pack("<I", crc32c(body))


def check_header(data: bytes) -> tuple[int, int]:
    """Validate a header and return ``(major, minor)``."""
    if len(data) < 8 or data[:8] != MAGIC:
        raise CorruptFileError("not a .kv file: bad magic bytes at offset 0")
    _magic, major, minor, size, _reserved, stored_crc = _HEADER.unpack(data)
    if major != MAJOR:
        raise UnsupportedVersionError(f"format version {major}.{minor}; this reader implements {MAJOR}.x")
    if crc32c(data[:60]) != stored_crc:
        raise ChecksumError("header CRC-32C mismatch")
    if size != HEADER_SIZE:
        raise CorruptFileError(f"header size {size}, version 1 requires {HEADER_SIZE}")
    return major, minor


@dataclass(frozen=True)
class Descriptor:
    """One record descriptor (64 bytes). ``offset`` is where the descriptor itself lies."""

    kind: int
    dtype: int
    codec: int
    layer: int
    head: int
    seq: int
    position: int
    rows: int
    width: int
    offset: int
    stored_size: int
    decoded_size: int
    payload_crc: int
    flags: int = 0

    @property
    def payload_offset(self) -> int:
        return self.offset + DESCRIPTOR_SIZE

    @property
    def end(self) -> int:
        """Offset just past the payload (before padding)."""
        return self.offset + DESCRIPTOR_SIZE + self.stored_size

    def pack(self) -> bytes:
        body = _DESCRIPTOR.pack(DESCRIPTOR_MAGIC, *(getattr(self, name) for name in _VALUES), 0)[:60]
        return body + struct.pack("<I", crc32c(body))

    @classmethod
    def from_fields(cls, fields: tuple[Any, ...]) -> Descriptor:
        """From one `DESCRIPTOR_DTYPE` record as a tuple (``table[i].item()``), unchecked: a
        chunk-table entry, which the index CRC already covers."""
        return cls(**dict(zip(_VALUES, fields[1:-1], strict=True)))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> Descriptor:
        """Parse a descriptor, checking magic and its own CRC (not the payload)."""
        if bytes(data[:4]) != DESCRIPTOR_MAGIC:
            raise CorruptFileError("bad descriptor magic")
        fields = _DESCRIPTOR.unpack(data)
        if crc32c(data[:60]) != fields[15]:
            raise ChecksumError("descriptor CRC-32C mismatch")
        return cls.from_fields(fields)


@dataclass(frozen=True)
class Footer:
    """The last 64 bytes: where the index lies and the CRC over header + index."""

    index_offset: int
    chunk_count: int
    json_size: int
    index_crc: int
    minor: int = MINOR

    def pack(self) -> bytes:
        body = _FOOTER.pack(
            FOOTER_MAGIC,
            self.index_offset,
            self.chunk_count,
            self.json_size,
            self.index_crc,
            MAJOR,
            self.minor,
            b"",
            0,
        )[:60]
        return body + struct.pack("<I", crc32c(body))

    @classmethod
    def unpack(cls, data: bytes) -> Footer:
        magic, index_offset, chunk_count, json_size, index_crc, major, minor, _r, stored_crc = _FOOTER.unpack(
            data
        )
        if magic != FOOTER_MAGIC:
            raise CorruptFileError("no footer magic at end of file")
        if crc32c(data[:60]) != stored_crc:
            raise ChecksumError("footer CRC-32C mismatch")
        if major != MAJOR:
            raise UnsupportedVersionError(f"footer says version {major}.{minor}")
        return cls(index_offset, chunk_count, json_size, index_crc, minor)
