"""float16 rows to float32, compiled (C, `native`): numpy's
``astype`` converts one value at a time; this loop vectorizes the common cases
(`python -m benchmarks.kernel_bench` times both).

A normal half moves its exponent and mantissa into place with integer operations (exponent bias
15 -> 127: add ``112 << 23``); an infinity or NaN keeps its payload with an all-ones exponent;
zero stays zero. Subnormal halves (magnitude below 2**-14), rare in K/V data, are fixed in a
second pass only where the first found one: ``mantissa * 2**-24``, exact in float32. Every one of
the 65,536 halves converts to the bits numpy gives (`tests/analysis/kernels/test_arrays.py`).
"""

from __future__ import annotations

import numpy as np

from . import native

AVAILABLE = native.AVAILABLE


def to_float32(rows: np.ndarray, out: np.ndarray) -> None:
    """C-contiguous float16 ``rows`` into C-contiguous float32 ``out`` of the same shape (the C
    conversion; ``astype`` where it is not built)."""
    flat = out.reshape(-1)
    if native.AVAILABLE:
        native.halves_to_float32(rows.reshape(-1).view(np.uint16), flat)
    else:
        flat[:] = rows.reshape(-1).astype(np.float32)
