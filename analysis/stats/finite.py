"""Non-finite values (inf, -inf, NaN) in K/V rows: counted, and their rows left out.

Real float16 caches overflow, and one such value would turn every sum of its head into NaN (and
the covariance spectrum into a LAPACK failure). A row ``(dim,)`` holding any non-finite value is
therefore left out of every statistic of its head; the head's row in the table counts what was
left out (``nonfinite_rows``, ``nonfinite_values``), and ``n_tokens`` counts the rows the
statistics are over.

Finding nothing is the common case and must cost little beside the statistics: `any_nonfinite`
is one pass at memory speed (float32: the BLAS dot product of the values with themselves, which
is non-finite when a value is; float16/bfloat16: the largest magnitude bits; rates in
the benchmarks in `benchmarks/`). Only when it fires are the rows tested exactly, on the exponent bits of the
stored dtype (all ones: inf or NaN); `split` copies only then. The mlx pipeline skips even that
pass: the device's sum of squares of each piece says whether to look (`kernels.mlx_fold.fold_checked`).
"""

from __future__ import annotations

import threading

import numpy as np

_PIECE = 1 << 14  # rows tested at a time (bounded scratch memory)

_EXPONENT = {
    "float32": (np.uint32, 0x7F800000),
    "float16": (np.uint16, 0x7C00),
    "bfloat16": (np.uint16, 0x7F80),
}


_SCRATCH = threading.local()


def any_nonfinite(rows: np.ndarray) -> bool:
    """Whether ``rows`` may hold a non-finite value: never False when one does; True without one
    only for float32 rows whose squares overflow (beyond 1.8e19), which `bad_rows` then clears."""
    if rows.size == 0:
        return False
    flat = np.ascontiguousarray(rows).reshape(-1)
    if flat.dtype in (np.float32, np.float64):
        with np.errstate(all="ignore"):
            return not np.isfinite(np.dot(flat, flat))
    exponent = _EXPONENT.get(flat.dtype.name)
    if exponent is None or exponent[0] is not np.uint16:
        return not bool(np.isfinite(flat).all())
    bits = flat.view(np.uint16)
    scratch = getattr(_SCRATCH, "buffer", None)
    if scratch is None:
        scratch = _SCRATCH.buffer = np.empty(1 << 20, np.uint16)
    threshold = exponent[1]
    for start in range(0, bits.size, scratch.size):
        piece = bits[start : start + scratch.size]
        magnitude = scratch[: piece.size]
        np.bitwise_and(piece, 0x7FFF, out=magnitude)
        if int(magnitude.max()) >= threshold:
            return True
    return False


def bad_rows(rows: np.ndarray) -> np.ndarray | None:
    """``(n,)`` bool: the rows of ``rows`` ``(n, dim)`` that hold a non-finite value; None when
    every value is finite (the common case: nothing is allocated beyond the scratch)."""
    n = rows.shape[0]
    if not n or not any_nonfinite(rows):
        return None
    found: np.ndarray | None = None
    for start in range(0, n, _PIECE):
        piece = rows[start : start + _PIECE]
        exponent = _EXPONENT.get(piece.dtype.name)
        if exponent is None:
            bad = ~np.isfinite(piece).all(axis=1)
        else:
            unsigned, mask = exponent
            bits = np.ascontiguousarray(piece).view(unsigned) & unsigned(mask)
            bad = (bits == unsigned(mask)).any(axis=1)
        if bad.any():
            if found is None:
                found = np.zeros(n, bool)
            found[start : start + piece.shape[0]] = bad
    return found


def count_values(rows: np.ndarray) -> int:
    """How many values of ``rows`` are inf, -inf or NaN."""
    if rows.size == 0:
        return 0
    exponent = _EXPONENT.get(rows.dtype.name)
    if exponent is None:
        return int((~np.isfinite(rows)).sum())
    unsigned, mask = exponent
    return int(((np.ascontiguousarray(rows).view(unsigned) & unsigned(mask)) == unsigned(mask)).sum())


def split(rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``rows`` ``(n, dim)`` and ``positions`` ``(n,)`` without the rows that hold a non-finite
    value, then how many rows and values were left out (``rows`` itself, no copy, when none)."""
    bad = bad_rows(rows)
    if bad is None:
        return rows, positions, 0, 0
    values = count_values(rows[bad])
    keep = ~bad
    return rows[keep], np.asarray(positions)[keep], int(bad.sum()), values
