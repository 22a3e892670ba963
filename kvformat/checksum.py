"""CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the only checksum of the format.

Check value: ``crc32c(b"123456789") == 0xE3069283``.
"""

from __future__ import annotations

import crc32c as _crc32c


def crc32c(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """Return the CRC-32C of ``data``, continuing from ``value`` (a previous result)."""
    return int(_crc32c.crc32c(data, value))
