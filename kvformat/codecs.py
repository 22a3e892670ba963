"""Chunk codecs: how a chunk's decoded bytes become the bytes stored on disk, and back.

Each codec is a small object with a ``code`` (stored in every chunk descriptor), a ``name``
(used in APIs and JSON), ``encode`` and ``decode``. Decoding is bounded: a codec never produces
more than the ``decoded_size`` the descriptor declares, and anything else is a `CorruptFileError`.
"""

from __future__ import annotations

import struct
import threading
from typing import Protocol

import numpy as np
import zstandard

from kvformat.errors import CorruptFileError, InvalidArgumentError, UnknownNameError, UnsupportedFeatureError

BytesLike = bytes | bytearray | memoryview

DEFAULT_ZSTD_LEVEL = 3


class Codec(Protocol):
    """Encode decoded chunk bytes to stored bytes and back."""

    code: int
    name: str

    def encode(self, data: memoryview, itemsize: int) -> list[BytesLike]:
        """Return the stored payload as a list of buffers written back to back."""
        ...

    def decode(self, stored: memoryview, decoded_size: int, itemsize: int) -> BytesLike:
        """Return exactly ``decoded_size`` bytes, or raise `CorruptFileError`."""
        ...


class Raw:
    """``raw`` (code 0): stored bytes are the little-endian array bytes; mmap-able in place."""

    code = 0
    name = "raw"

    def encode(self, data: memoryview, itemsize: int) -> list[BytesLike]:
        return [data]

    def decode(self, stored: memoryview, decoded_size: int, itemsize: int) -> BytesLike:
        if len(stored) != decoded_size:
            raise CorruptFileError(f"raw chunk stores {len(stored)} bytes, declares {decoded_size}")
        return stored


_LOCAL = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (one per thread: a decompressor is not shared by threads, and
    making one per frame cost more than decoding a small frame)."""
    decompressor: zstandard.ZstdDecompressor | None = getattr(_LOCAL, "decompressor", None)
    if decompressor is None:
        decompressor = _LOCAL.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def _zstd_decode(frame: memoryview, size: int) -> bytes:
    """Decode exactly one zstd frame that must declare a content size equal to ``size``."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise CorruptFileError(f"zstd frame header unreadable: {exc}") from None
    if declared != size:
        raise CorruptFileError(f"zstd frame declares {declared} bytes, chunk declares {size}")
    try:
        out = _decompressor().decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptFileError(f"zstd frame does not decode: {exc}") from None
    if len(out) != size:
        raise CorruptFileError(f"zstd frame decoded to {len(out)} bytes, expected {size}")
    return out


class Zstd:
    """``zstd`` (code 1): the payload is exactly one zstd frame with its content size set."""

    code = 1
    name = "zstd"

    def __init__(self, level: int = DEFAULT_ZSTD_LEVEL) -> None:
        self.level = level
        self._made: zstandard.ZstdCompressor | None = None  # made on first encode

    @property
    def _compressor(self) -> zstandard.ZstdCompressor:
        if self._made is None:
            self._made = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return self._made

    def encode(self, data: memoryview, itemsize: int) -> list[BytesLike]:
        return [self._compressor.compress(data)]

    def decode(self, stored: memoryview, decoded_size: int, itemsize: int) -> BytesLike:
        return _zstd_decode(stored, decoded_size)


class BytePlaneZstd:
    """``byteplane-zstd`` (code 2): byte ``i`` of every element forms plane ``i``; each plane
    is one zstd frame. Payload: ``itemsize`` u64 frame lengths, then the frames, plane 0 (least
    significant byte) first. Exponent bytes compress far better once separated from mantissas.
    """

    code = 2
    name = "byteplane-zstd"

    def __init__(self, level: int = DEFAULT_ZSTD_LEVEL) -> None:
        self.level = level
        self._made: zstandard.ZstdCompressor | None = None  # made on first encode

    @property
    def _compressor(self) -> zstandard.ZstdCompressor:
        if self._made is None:
            self._made = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return self._made

    def encode(self, data: memoryview, itemsize: int) -> list[BytesLike]:
        grid = np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize)
        frames = [self._compressor.compress(np.ascontiguousarray(grid[:, i]).data) for i in range(itemsize)]
        lengths = struct.pack(f"<{itemsize}Q", *(len(f) for f in frames))
        return [lengths, *frames]

    def decode(self, stored: memoryview, decoded_size: int, itemsize: int) -> BytesLike:
        table = 8 * itemsize
        if len(stored) < table:
            raise CorruptFileError("byteplane payload shorter than its frame-length table")
        lengths = struct.unpack_from(f"<{itemsize}Q", stored)
        if table + sum(lengths) != len(stored):
            raise CorruptFileError(
                f"byteplane frame lengths sum to {table + sum(lengths)}, payload is {len(stored)}"
            )
        count = decoded_size // itemsize
        out = np.empty((count, itemsize), dtype=np.uint8)
        start = table
        for plane, length in enumerate(lengths):
            out[:, plane] = np.frombuffer(_zstd_decode(stored[start : start + length], count), np.uint8)
            start += length
        return out.reshape(-1).data


BY_CODE: dict[int, type[Raw] | type[Zstd] | type[BytePlaneZstd]] = {
    Raw.code: Raw,
    Zstd.code: Zstd,
    BytePlaneZstd.code: BytePlaneZstd,
}
NAMES = tuple(codec.name for codec in BY_CODE.values())
"""Every codec's name, in code order: the one list (the CLI's choices and the tests use it)."""

_DECODERS: dict[int, Codec] = {code: codec() for code, codec in BY_CODE.items()}


def from_code(code: int) -> Codec:
    """The codec for an on-disk code (one shared instance per code: decoding never depends on
    the compression level, and decoding is safe on any thread)."""
    try:
        return _DECODERS[code]
    except KeyError:
        raise UnsupportedFeatureError(f"unknown codec code {code}") from None


def parse(spec: str | Codec) -> Codec:
    """Parse ``"raw"``, ``"zstd"``, ``"zstd:LEVEL"``, ``"byteplane-zstd[:LEVEL]"`` or pass a codec."""
    if not isinstance(spec, str):
        return spec
    name, _, level_text = spec.partition(":")
    if name == "raw" and not level_text:
        return Raw()
    if name in ("zstd", "byteplane-zstd"):
        try:
            level = int(level_text) if level_text else DEFAULT_ZSTD_LEVEL
        except ValueError:
            raise InvalidArgumentError(f"codec level must be an integer, got {level_text!r}") from None
        return Zstd(level) if name == "zstd" else BytePlaneZstd(level)
    raise UnknownNameError(f"unknown codec {spec!r}; choose from {', '.join(NAMES)} (zstd may take ':LEVEL')")
