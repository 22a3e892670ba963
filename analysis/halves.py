"""float16 rows to float32, compiled (C where built, `native`; else numba ``nogil``): numpy's
``astype`` converts one value at a time (`python -m benchmarks.kernel_bench` times both); this loop
vectorizes the common cases, about 3x faster (the C build 1.4-2.3x faster again:
`benchmarks/kernel_bench.py`).

A normal half moves its exponent and mantissa into place with integer operations (exponent bias
15 -> 127: add ``112 << 23``); an infinity or NaN keeps its payload with an all-ones exponent;
zero stays zero. Subnormal halves (magnitude below 2**-14), rare in K/V data, are fixed in a
second pass only where the first found one: ``mantissa * 2**-24``, exact in float32. Every one of
the 65,536 halves converts to the bits numpy gives (`tests/test_arrays.py`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import native

numba: Any = native.numba_fallback()  # (KVSNAP_KERNEL=numpy keeps it: that selects the accumulator's path)


def _convert(bits: np.ndarray, out_bits: np.ndarray, out: np.ndarray) -> None:
    """``bits`` (uint16, flat) as halves into ``out`` (float32, flat), written through its uint32
    view ``out_bits``."""
    subnormal = np.uint32(0)
    for i in range(bits.size):
        h = np.uint32(bits[i])
        magnitude = h & np.uint32(0x7FFF)
        sign = (h & np.uint32(0x8000)) << np.uint32(16)
        normal = (magnitude << np.uint32(13)) + np.uint32(0x38000000)
        special = np.uint32(0x7F800000) | ((magnitude & np.uint32(0x3FF)) << np.uint32(13))
        if magnitude >= np.uint32(0x7C00):
            value = special
        elif magnitude >= np.uint32(0x400):
            value = normal
        else:
            value = np.uint32(0)
        subnormal |= np.uint32(magnitude - np.uint32(1) < np.uint32(0x3FF))
        out_bits[i] = sign | value
    if subnormal:
        scale = np.float32(2.0**-24)
        for i in range(bits.size):
            h = np.uint32(bits[i])
            magnitude = h & np.uint32(0x7FFF)
            if magnitude != np.uint32(0) and magnitude < np.uint32(0x400):
                f = np.float32(magnitude) * scale
                out[i] = -f if h & np.uint32(0x8000) else f


if numba is not None:
    _convert = numba.njit(cache=True, nogil=True)(_convert)

AVAILABLE = native.AVAILABLE or numba is not None


def to_float32(rows: np.ndarray, out: np.ndarray) -> None:
    """C-contiguous float16 ``rows`` into C-contiguous float32 ``out`` of the same shape."""
    flat = out.reshape(-1)
    if native.AVAILABLE:
        native.halves_to_float32(rows.reshape(-1).view(np.uint16), flat)
    else:
        _convert(rows.reshape(-1).view(np.uint16), flat.view(np.uint32), flat)
