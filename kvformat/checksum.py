"""CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the only checksum of the format.

Check value: ``crc32c(b"123456789") == 0xE3069283``.
"""

from __future__ import annotations

import crc32c as _crc32c

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
