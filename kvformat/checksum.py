"""CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the only checksum of the format.

Check value: ``crc32c(b"123456789") == 0xE3069283``.
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c as _crc32c
import numpy as np

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
        raise ValueError("rows must be a 2-D uint8 array")
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
