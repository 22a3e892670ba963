"""CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the only checksum of the format.

Check value: ``crc32c(b"123456789") == 0xE3069283``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from kvformat.errors import InvalidArrayError


def _crc32c_module() -> Any:
    """The crc32c package's compiled module, loaded without running the package's
    ``__init__``, which looks up its own version in the installed packages' metadata (importing
    ``importlib.metadata``, which every fresh process would pay for, more where many packages are
    installed) and builds its command-line tool. A plain ``import crc32c`` where the package's
    layout is not the expected one."""
    import importlib.machinery
    import importlib.util

    loader = (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES)
    try:
        package = importlib.util.find_spec("crc32c")  # a top-level name: found, not imported
        folders = package.submodule_search_locations if package is not None else None
        for folder in folders or []:
            spec = importlib.machinery.FileFinder(folder, loader).find_spec("crc32c._crc32c")
            if spec is not None and spec.loader is not None:
                module: ModuleType = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                if callable(getattr(module, "crc32c", None)):
                    return module
    except (ImportError, OSError):
        pass
    import crc32c

    return crc32c


_crc32c = _crc32c_module()

RELEASE_GIL_BYTES = 64 * 1024
"""Buffers this large are checksummed without holding the GIL, so the writer's helper thread
(which checksums the next chunks) never stalls the thread writing the current ones. Smaller ones
keep it: releasing and re-taking it costs more than the checksum."""

try:
    _crc32c.crc32c(b"", 0, gil_release_mode=0)
    _MODES = True
except TypeError:  # an old crc32c without the keyword: its default applies
    _MODES = False


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """Return the CRC-32C of ``data``, continuing from ``value`` (a previous result)."""
    if not _MODES:
        return int(_crc32c.crc32c(data, value))
    release = (data.nbytes if isinstance(data, memoryview) else len(data)) >= RELEASE_GIL_BYTES
    return int(_crc32c.crc32c(data, value, gil_release_mode=1 if release else 0))


def crc32c_many(buffers: Sequence[bytes | bytearray | memoryview]) -> np.ndarray:
    """CRC-32C of each buffer (flat byte buffers), as a ``(len(buffers),)`` uint32 array: one C
    call per buffer and nothing else in Python (the writer checksums a snapshot's chunks so)."""
    function = _crc32c.crc32c
    if not _MODES:
        return np.array([function(b) for b in buffers], np.uint32)
    # Positional arguments: the keyword form costs twice the call.
    return np.array(
        [function(b, 0, 1 if len(b) >= RELEASE_GIL_BYTES else 0) for b in buffers], np.uint32
    ).reshape(-1)


def crc32c_slices(buffer: memoryview, starts: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """CRC-32C of ``buffer[start : start + size]`` for each pair, as ``(n,)`` uint32: slicing
    and checksumming in one loop (verify and recover check hundreds of thousands of small
    payloads so)."""
    function = _crc32c.crc32c
    if not _MODES:
        return np.array([function(buffer[a : a + n]) for a, n in zip(starts, sizes, strict=True)], np.uint32)
    mode = 1 if sizes and max(sizes) >= RELEASE_GIL_BYTES else 0
    return np.array(
        [function(buffer[a : a + n], 0, mode) for a, n in zip(starts, sizes, strict=True)], np.uint32
    ).reshape(-1)


_ROW_TABLES: dict[int, tuple[np.ndarray, int]] = {}


def _row_table(length: int) -> tuple[np.ndarray, int]:
    """CRC-32C is affine over GF(2): ``crc(m) = crc(0...0) ^ XOR_j T[j, m_j]``. Returns ``T``
    ``(length, 256)`` uint32 and ``crc(0...0)`` for messages of ``length`` bytes."""
    cached = _ROW_TABLES.get(length)
    if cached is None:
        zero = int(_crc32c.crc32c(bytes(length)))
        table = np.zeros((length, 256), np.uint32)
        message = bytearray(length)
        for j in range(length):
            for bit in range(8):  # linear in the byte's bits too: 8 CRCs per position
                message[j] = 1 << bit
                table[j, 1 << bit] = int(_crc32c.crc32c(bytes(message))) ^ zero
            message[j] = 0
            for b in range(1, 256):
                low = b & -b
                if b != low:
                    table[j, b] = table[j, low] ^ table[j, b ^ low]
        cached = _ROW_TABLES[length] = (table, zero)
    return cached


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """CRC-32C of every row of a ``(n, length)`` uint8 array, as ``(n,)`` uint32, computed with
    numpy alone (table lookups, no call per row): the writer checksums thousands of 60-byte
    descriptors per snapshot this way."""
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise InvalidArrayError("rows must be a 2-D uint8 array")
    n, length = rows.shape
    if n == 0:
        return np.zeros(0, np.uint32)
    table, _ = _row_table(length)
    # Linearity again: crc(row) = crc(first) ^ XOR_j T[j, row_j ^ first_j], and only the byte
    # columns that vary contribute (a run of descriptors differs in a few fields only).
    first = rows[0]
    varying = np.flatnonzero(np.any(rows != first, axis=0))
    base = np.uint32(crc32c(first.tobytes()))
    if varying.size == 0:
        return np.full(n, base, np.uint32)
    contributions = table[varying, rows[:, varying] ^ first[varying]]  # (n, varying)
    return np.bitwise_xor.reduce(contributions, axis=1) ^ base


# --- Checking many back-to-back CRCs with one pass -------------------------------------------
#
# CRC-32C is affine over GF(2). Write ``reg`` for the 32-bit register before the final XOR with
# 0xFFFFFFFF. Feeding ``n`` zero bytes maps a register ``r`` to ``Z_n(r)``, a linear map. The
# *linear part* of a message ``m`` (its CRC from a zero register, without the final XOR) is
# ``lin(m) = crc(m) ^ crc(n zero bytes)``, and for a concatenation ``lin(a + b) = Z_|b|(lin(a)) ^
# lin(b)``. So the CRC of a long run of records follows from the records' own CRCs with a few
# vectorized table lookups per record, and one C pass over the run checks them all at once.

_ONES = 0xFFFFFFFF
_BITS = ((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(bool)  # (256, 8): bits of each byte


class ZeroShift:
    """``Z_n``: the CRC-32C register after ``n`` zero bytes, as a linear map of 32-bit values
    (``columns[b]`` is the image of bit ``b``; four 256-entry tables apply it to arrays)."""

    def __init__(self, nbytes: int, columns: np.ndarray) -> None:
        self.nbytes = nbytes
        self.columns = columns.astype(np.uint32)
        pieces = np.where(_BITS[None, :, :], self.columns.reshape(4, 1, 8), np.uint32(0))
        self.tables = np.bitwise_xor.reduce(pieces, axis=2)  # (4, 256): byte k's contribution

    def apply(self, values: np.ndarray) -> np.ndarray:
        """``Z_n`` of every element of a uint32 array (a new array)."""
        if self.nbytes == 0:
            return values.astype(np.uint32)
        if values.size >= _WIDE_MINIMUM:  # two lookups in 65536-entry tables: ~3x faster
            low, high = _wide_tables(self)
            halves = np.ascontiguousarray(values, np.uint32).view(np.uint16).reshape(*values.shape, 2)
            wide = np.take(low, halves[..., 0 if _LITTLE else 1])
            wide ^= np.take(high, halves[..., 1 if _LITTLE else 0])
            return wide
        t = self.tables
        out = t[0][values & 0xFF]
        out ^= t[1][(values >> 8) & 0xFF]
        out ^= t[2][(values >> 16) & 0xFF]
        out ^= t[3][values >> 24]
        return out

    def apply_one(self, value: int) -> int:
        """``Z_n`` of one 32-bit value, with Python ints (no array made)."""
        lists = self.__dict__.get("_lists")
        if lists is None:
            lists = self.__dict__["_lists"] = [t.tolist() for t in self.tables]
        t0, t1, t2, t3 = lists
        return t0[value & 0xFF] ^ t1[(value >> 8) & 0xFF] ^ t2[(value >> 16) & 0xFF] ^ t3[value >> 24]

    def then(self, other: ZeroShift) -> ZeroShift:
        """``Z_(n+m)``: this shift, then ``other``."""
        return ZeroShift(self.nbytes + other.nbytes, other.apply(self.columns))


_SHIFTS: dict[int, ZeroShift] = {}

_WIDE_MINIMUM = 1 << 16  # arrays at least this long are shifted with 16-bit tables
_LITTLE = np.little_endian
_WIDE: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # 512 KiB per shift, a few kept


def _wide_tables(shift: ZeroShift) -> tuple[np.ndarray, np.ndarray]:
    """``Z_n``'s contribution of a value's low and high 16 bits, ``(65536,)`` uint32 each (the
    few shifts of large arrays, cached: a series verify uses about four)."""
    cached = _WIDE.get(shift.nbytes)
    if cached is None:
        every = np.arange(1 << 16, dtype=np.uint32)
        low_byte, high_byte = every & 0xFF, every >> 8
        t = shift.tables
        cached = (t[0][low_byte] ^ t[1][high_byte], t[2][low_byte] ^ t[3][high_byte])
        if len(_WIDE) >= 16:
            _WIDE.clear()
        _WIDE[shift.nbytes] = cached
    return cached


def zero_shift(nbytes: int) -> ZeroShift:
    """``Z_n`` for any ``n >= 0`` (cached), built from powers of two."""
    cached = _SHIFTS.get(nbytes)
    if cached is not None:
        return cached
    if nbytes == 0:
        shift = ZeroShift(0, np.uint32(1) << np.arange(32, dtype=np.uint32))
    elif nbytes == 1:
        zero = bytes(1)
        # crc32c(data, value) starts from register value ^ 0xFFFFFFFF and returns register ^ ones.
        images = [int(_crc32c.crc32c(zero, (1 << b) ^ _ONES)) ^ _ONES for b in range(32)]
        shift = ZeroShift(1, np.array(images, np.uint32))
    elif nbytes & (nbytes - 1) == 0:
        half = zero_shift(nbytes // 2)
        shift = half.then(half)
    else:
        low = nbytes & -nbytes
        shift = zero_shift(nbytes - low).then(zero_shift(low))
    if len(_SHIFTS) > 4096:
        _SHIFTS.clear()
    _SHIFTS[nbytes] = shift
    return shift


def zeros_crc(nbytes: int) -> int:
    """CRC-32C of ``nbytes`` zero bytes, without making them."""
    return int(zero_shift(nbytes).apply(np.array([_ONES], np.uint32))[0]) ^ _ONES


def linear_crc(data: bytes | bytearray | memoryview) -> int:
    """The linear part of ``data``'s CRC-32C (from a zero register, no final XOR): one C pass."""
    return crc32c(data, _ONES) ^ _ONES


def linear_parts(crcs: np.ndarray, nbytes: int) -> np.ndarray:
    """Linear parts of messages of ``nbytes`` bytes, from their CRC-32Cs (uint32 array)."""
    return crcs.astype(np.uint32) ^ np.uint32(zeros_crc(nbytes))


def linear_concatenation(parts: np.ndarray, nbytes: int) -> np.ndarray:
    """Linear parts of concatenations: ``parts`` ``(..., count)`` holds the linear parts of
    ``count`` pieces of ``nbytes`` bytes each; returns ``(...)``, the linear part of each row's
    pieces laid end to end. A balanced tree of shifts: about one table lookup per piece."""
    values = parts.astype(np.uint32, copy=False)
    size = nbytes
    while values.shape[-1] > 1:
        if values.shape[-1] & 1:  # a leading piece of zeros: its linear part is 0, changes nothing
            values = np.concatenate((np.zeros((*values.shape[:-1], 1), np.uint32), values), axis=-1)
        shifted = zero_shift(size).apply(values[..., 0::2])
        shifted ^= values[..., 1::2]
        values = shifted
        size *= 2
    if values.shape[-1] == 0:
        return np.zeros(values.shape[:-1], np.uint32)
    return values[..., 0]


def self_checked_linear(nbytes: int) -> int:
    """Linear part of any message of ``nbytes`` bytes whose last 4 bytes are the CRC-32C of the
    rest, little-endian (a record descriptor: 60 + 4): the same constant for all of them (the CRC
    residue), so a run of valid descriptors needs no per-descriptor work."""
    body = nbytes - 4
    # lin(body + w) = Z_4(lin(body) ^ w) for a little-endian word w; lin(body) = crc ^ zeros_crc.
    return int(zero_shift(4).apply(np.array([zeros_crc(body)], np.uint32))[0])


def repeated_linear(part: int, nbytes: int, count: int) -> int:
    """Linear part of ``count`` messages of ``nbytes`` bytes each, laid end to end, when every
    one's linear part is ``part`` (a table of self-checked descriptors): by doubling, about
    ``log2(count)`` shifts."""
    result, block, size = 0, part, nbytes  # block: the linear part of 2^j messages, size bytes
    while count:
        if count & 1:
            result = zero_shift(size).apply_one(result) ^ block
        block ^= zero_shift(size).apply_one(block)
        size *= 2
        count >>= 1
    return result


def concatenated_linear(pieces: Iterable[tuple[int, int]]) -> int:
    """Linear part of pieces laid end to end, from each one's ``(nbytes, linear part)``, in order."""
    value = 0
    for nbytes, part in pieces:
        value = zero_shift(nbytes).apply_one(value) ^ part
    return value


def records_linear(
    payload_crcs: np.ndarray, size: int, stride: int, header: int, padded: bool = True
) -> np.ndarray:
    """Linear part of runs of back-to-back records, each a self-checked descriptor of ``header``
    bytes (`self_checked_linear`), a payload of ``size`` bytes whose CRC-32C is in
    ``payload_crcs`` ``(..., count)``, then zero padding up to ``stride`` bytes. Returns ``(...)``:
    what `linear_crc` of each run's bytes is if every CRC holds and every padding byte is zero.
    ``padded=False``: each run ends at its last payload's end (a file cut after it)."""
    padding = stride - header - size
    descriptor = zero_shift(size).apply_one(self_checked_linear(header))
    payloads = payload_crcs.astype(np.uint32)  # a copy, changed in place below
    if padded:
        payloads ^= np.uint32(zeros_crc(size) ^ descriptor)  # linear parts, then the descriptor's
        records = zero_shift(padding).apply(payloads) if padding else payloads
        return linear_concatenation(records, stride)
    payloads ^= np.uint32(zeros_crc(size))
    records = zero_shift(padding).apply(payloads[..., :-1] ^ descriptor)
    before = zero_shift(header + size).apply(linear_concatenation(records, stride))
    return before ^ payloads[..., -1] ^ descriptor
