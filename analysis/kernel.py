"""The compiled one-pass kernel behind `HeadAccumulator.add` (numba).

One call reads a piece of rows ``(n_tokens, dim)`` float32 once, row by row while the row is in
L1, and updates every per-element sum of the catalogue in place: norms and their histogram,
power sums up to the 4th order, channel absmax, the unit-vector sum, RoPE pair energy, norm by
position bin, the per-row peak, and min-max quantization error at 8/4/2 bits in groups of 32
channels per token and 32 tokens per channel. The Gram matrix stays with BLAS. The arithmetic
is that of the numpy path in `analysis.stats` (float64 sums; quantization in float32 summed in
float64), so the two agree to rounding (1e-9 relative); `tests/test_kernel.py` holds them to it.

``KVSNAP_KERNEL=numpy`` in the environment, or numba missing, selects the numpy path.
"""

from __future__ import annotations

import os

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None  # type: ignore[assignment]

AVAILABLE = numba is not None and os.environ.get("KVSNAP_KERNEL", "compiled") != "numpy"

LOG_LOW, LOG_HIGH, BINS = -8.0, 8.0, 2048
GROUP = 32


def _hist_bin(value: float) -> int:
    low = 10.0**LOG_LOW
    log = np.log10(value if value > low else low)
    index = int((log - LOG_LOW) / (LOG_HIGH - LOG_LOW) * BINS)
    return 0 if index < 0 else (BINS - 1 if index > BINS - 1 else index)


def _quantization_error(x: np.ndarray, levels: np.ndarray, out: np.ndarray, tokens: bool) -> None:
    """Add the squared min-max quantization error of ``x`` ``(n, dim)`` float32 at each of the
    three ``levels`` to ``out``: groups of GROUP channels per token (``tokens``) or of GROUP
    tokens per channel; a last partial group is quantized on its own. One pass per group
    computes all three levels."""
    n, dim = x.shape
    one = np.float32(1.0)
    l0, l1, l2 = np.float32(levels[0]), np.float32(levels[1]), np.float32(levels[2])
    if tokens:
        acc = np.zeros((3, GROUP), np.float64)  # per-lane sums: vectorizes without reassociation
        for i in range(n):
            for start in range(0, dim, GROUP):
                stop = min(start + GROUP, dim)
                low = x[i, start]
                high = x[i, start]
                for j in range(start + 1, stop):
                    low = min(low, x[i, j])
                    high = max(high, x[i, j])
                wide = high > low
                s0 = (high - low) / l0 if wide else one
                s1 = (high - low) / l1 if wide else one
                s2 = (high - low) / l2 if wide else one
                for j in range(start, stop):
                    v = x[i, j]
                    d = v - low
                    e0 = np.rint(d / s0) * s0 + low - v
                    e1 = np.rint(d / s1) * s1 + low - v
                    e2 = np.rint(d / s2) * s2 + low - v
                    acc[0, j - start] += np.float64(e0 * e0)
                    acc[1, j - start] += np.float64(e1 * e1)
                    acc[2, j - start] += np.float64(e2 * e2)
        for b in range(3):
            out[b] += acc[b].sum()
        return
    lows = np.empty(dim, np.float32)
    highs = np.empty(dim, np.float32)
    steps = np.empty((3, dim), np.float32)
    sums = np.zeros((3, dim), np.float64)
    for start in range(0, n, GROUP):
        stop = min(start + GROUP, n)
        lows[:] = x[start]
        highs[:] = x[start]
        for i in range(start + 1, stop):
            for j in range(dim):
                lows[j] = min(lows[j], x[i, j])
                highs[j] = max(highs[j], x[i, j])
        for j in range(dim):
            wide = highs[j] > lows[j]
            steps[0, j] = (highs[j] - lows[j]) / l0 if wide else one
            steps[1, j] = (highs[j] - lows[j]) / l1 if wide else one
            steps[2, j] = (highs[j] - lows[j]) / l2 if wide else one
        for i in range(start, stop):
            for j in range(dim):
                v = x[i, j]
                low = lows[j]
                d = v - low
                e0 = np.rint(d / steps[0, j]) * steps[0, j] + low - v
                e1 = np.rint(d / steps[1, j]) * steps[1, j] + low - v
                e2 = np.rint(d / steps[2, j]) * steps[2, j] + low - v
                sums[0, j] += np.float64(e0 * e0)
                sums[1, j] += np.float64(e1 * e1)
                sums[2, j] += np.float64(e2 * e2)
    for b in range(3):
        out[b] += sums[b].sum()


def _accumulate(
    x: np.ndarray,
    positions: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    levels: np.ndarray,
    scalars: np.ndarray,
    norm_hist: np.ndarray,
    peak_hist: np.ndarray,
    power: np.ndarray,
    absmax: np.ndarray,
    unit_sum: np.ndarray,
    band: np.ndarray,
    position_count: np.ndarray,
    position_norm: np.ndarray,
    peaks: np.ndarray,
) -> None:
    """Update the sums with ``x`` ``(n_tokens, dim)`` float32 at ``positions`` ``(n_tokens,)``
    (the quantization errors: `quantization_error`, compiled apart so that the fast-math flags of
    this pass do not reach its float32 arithmetic).

        ``scalars``: [sum ||x||, sum ||x||^2, min ||x||, max ||x||, sum ||x_0||, count of x_0];
        ``peaks`` ``(n_tokens,)`` receives each row's max |x|."""
    n, dim = x.shape
    bins = position_count.shape[0]
    row = np.empty(dim, np.float64)
    for i in range(n):
        square_sum = 0.0
        peak = 0.0
        for j in range(dim):
            v = np.float64(x[i, j])
            row[j] = v
            v2 = v * v
            square_sum += v2
            power[0, j] += v
            power[1, j] += v2
            power[2, j] += v2 * v
            power[3, j] += v2 * v2
            magnitude = abs(v)
            if magnitude > absmax[j]:
                absmax[j] = magnitude
            if magnitude > peak:
                peak = magnitude
        norm = np.sqrt(square_sum)
        scalars[0] += norm
        scalars[1] += square_sum
        scalars[2] = min(scalars[2], norm)
        scalars[3] = max(scalars[3], norm)
        inverse = 1.0 / max(norm, 1e-30)
        for j in range(dim):
            unit_sum[j] += row[j] * inverse
        for p in range(first.shape[0]):
            a = row[first[p]]
            b = row[second[p]]
            band[p] += a * a + b * b
        norm_hist[_hist_bin(norm)] += 1
        peak_hist[_hist_bin(peak)] += 1
        peaks[i] = peak
        position = positions[i]
        if position > 0:
            slot = int(np.floor(np.log2(np.float64(position)))) + 1
            slot = min(slot, bins - 1)
        else:
            slot = 0
            if position == 0:
                scalars[4] += norm
                scalars[5] += 1.0
        position_count[slot] += 1
        position_norm[slot] += norm


# Reassociation lets LLVM vectorize the float64 reductions of the main pass (sums move by ~1e-15
# relative). The quantization pass has no fast-math at all: its float32 arithmetic must round
# exactly as numpy's does, so its sums are kept per lane instead.
_FAST = {"reassoc", "nsz"}
if numba is not None:
    _hist_bin = numba.njit(cache=True, nogil=True)(_hist_bin)
    quantization_error = numba.njit(cache=True, nogil=True)(_quantization_error)
    accumulate = numba.njit(cache=True, nogil=True, fastmath=_FAST)(_accumulate)
else:  # pragma: no cover
    quantization_error = _quantization_error
    accumulate = _accumulate
