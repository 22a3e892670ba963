"""The fused compiled kernel behind `HeadAccumulator.add` (C where built, else numba).

One call walks a piece of rows ``(n_tokens, dim)`` float32 in tiles of `GROUP` rows (16 KiB for
128 channels, so a tile stays in L1) and updates, for the statistic groups asked for, every
per-element sum of the catalogue in place:

- the row pass (`_row_pass`, float64 sums): squared norms, channel power sums up to the 4th
  order, channel absmax and the per-row peak, the unit-vector sum, RoPE pair energy;
- the quantization pass (`_quant_tile`, float32 arithmetic as the definition says): min-max
  quantization error at 8/4/2 bits in groups of `GROUP` channels per token and `GROUP` tokens per
  channel, both over the tile the row pass has just read.

After the tiles, per row: the log histogram bins of the norm and of the peak (`_hist_bins`:
exact edges and a guess from the float's top bits, no logarithm: 4.4 ns a value against 8.8 ns
for ``log10``, which as a call inside the row pass also spilled its vector registers) and the
norm-by-position bin (read off the position's float64 exponent).

The Gram matrix stays with BLAS (`compiled`). Every inner loop runs over contiguous
channels without a loop-carried dependency other than a reduction, so LLVM vectorizes it: the
float64 sums are reassociated (``fastmath`` reassoc), the absolute maxima are taken on the float
bits as integers (an exact, vectorizable max for non-negative floats), and the quantization pass,
which alone runs with no-NaN fast math, only sees tiles the row pass found finite (a non-finite
tile makes the quantization errors NaN, as the numpy reference would). A value's level is
``rint((v - low) * (1 / step))`` with the reciprocal rounded to float32 first, as the
definition (`catalogue.quant_error`) takes it: the levels equal the reference's, ties
included; the sums agree with it to ~1e-8 relative (their order differs).

Where the C build of these functions is installed (`analysis.native`), it stands in for them and
numba is not imported. ``KVSNAP_KERNEL=numba`` in the environment keeps numba; ``numpy``, or
neither installed, selects the numpy path.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from .. import native
from ..catalogue import BINS
from ..catalogue import QUANT_GROUP as GROUP

SELECTED = os.environ.get("KVSNAP_KERNEL", "compiled")  # compiled (C, else numba), numba, numpy
numba: Any = native.numba_fallback() if SELECTED != "numpy" else None

AVAILABLE = SELECTED != "numpy" and (native.AVAILABLE or numba is not None)

ABS_MASK = np.int32(0x7FFFFFFF)

# Flags (an int64 array, so one compiled version serves every selection).
NORMS, CHANNELS, ROPE, MEAN, QUANT = range(5)
FLAGS = 5

# Slots of the ``scalars`` float64 array the kernel updates.
NORM_SUM, SQUARE_SUM, NORM_MIN, NORM_MAX, FIRST_NORM_SUM, FIRST_COUNT = range(6)
SCALARS = 6

BLOCK = 4  # rows whose per-channel sums are added together (see `_row_pass`)


def hist_edges() -> np.ndarray:
    """``(BINS + 1,)`` float64 bin edges of the log histogram (`catalogue.hist_edges`)."""
    from ..catalogue import hist_edges as edges

    return edges(np.float64)


GUESS_SHIFT = 45  # a float64's exponent and top 7 mantissa bits: cells of 2^-7 relative width


@functools.cache
def hist_guesses() -> np.ndarray:
    """``(cells,)`` int64: the `hist_index` bin of the smallest float64 of each cell of the
    float64s from `hist_edges()[1]` to ``[-2]`` (a cell: the values sharing their bits above bit
    `GUESS_SHIFT`, 0.8% relative width against a bin's 1.8%), index 0 the cell of
    `hist_edges()[1]`: a value's first guess, within a bin of its own (`_hist_bins`)."""
    from ..catalogue import hist_index

    edges = hist_edges()
    first = int(edges[1:2].view(np.int64)[0]) >> GUESS_SHIFT
    last = int(edges[-2:-1].view(np.int64)[0]) >> GUESS_SHIFT
    starts = (np.arange(first, last + 1, dtype=np.int64) << GUESS_SHIFT).view(np.float64)
    return hist_index(starts)


def _hist_bins(values: np.ndarray, edges: np.ndarray, guesses: np.ndarray, hist: np.ndarray) -> None:
    """Count each of ``values`` ``(n,)`` float64 (``>= 0``, NaN or inf) in its log histogram
    bin, exactly as `catalogue.hist_index` bins it, without a logarithm (a call in a loop costs
    more than the logarithm): a first guess from the float's top bits (`hist_guesses`), then
    the bin's edges (`hist_edges`) step it to the right bin. NaN and inf go to bin 0, as in
    `hist_index`."""
    bits = values.view(np.int64)
    first = (edges[1:2].view(np.int64)[0]) >> GUESS_SHIFT
    cells = guesses.shape[0]
    for i in range(values.shape[0]):
        v = values[i]
        if not v < np.inf:  # NaN, inf
            hist[0] += 1
            continue
        cell = (bits[i] >> GUESS_SHIFT) - first
        k = guesses[0 if cell < 0 else (cells - 1 if cell >= cells else cell)]
        k += np.int64(v >= edges[k + 1])  # a cell is narrower than a bin: at most one step up
        while k > 0 and v < edges[k]:  # (the clamped cells at the ends: any steps, both ways)
            k -= 1
        while k < BINS - 1 and v >= edges[k + 1]:
            k += 1
        hist[k] += 1


def _row_pass(
    x: np.ndarray,
    bits: np.ndarray,
    start: int,
    stop: int,
    positions: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    flags: np.ndarray,
    scalars: np.ndarray,
    norm_hist: np.ndarray,
    power: np.ndarray,
    absmax_bits: np.ndarray,
    unit_sum: np.ndarray,
    band: np.ndarray,
    position_count: np.ndarray,
    position_norm: np.ndarray,
    peak_bits: np.ndarray,
    square_norms: np.ndarray,
    low_keys: np.ndarray,
    high_keys: np.ndarray,
    rows: np.ndarray,
    sums: np.ndarray,
) -> bool:
    """Rows ``start:stop`` of ``x`` (``bits``: the same memory as int32); with the QUANT flag,
    ``low_keys``/``high_keys`` ``(dim,)`` become these rows' channel minima/maxima as order keys.
    ``rows``: ``(BLOCK, dim)`` float64 scratch. Returns True when every value was finite.

    Rows go in blocks of `BLOCK`: first what is per row (the float64 copy and squared norm, the
    peak, the quantization keys, the norm's bins), then each per-channel sum once per block
    (``p[j] += a + b + c + d``), so the sums are loaded and stored once per block instead of
    once per row (that traffic, not the arithmetic, set the pace). Maxima and minima are taken
    branch-free (``w + ((v - w) & -(v > w))``): LLVM vectorizes that form, not a
    compare-and-select stored back to an array."""
    dim = x.shape[1]
    power1, power2, power3 = power[1], power[2], power[3]
    r0, r1, r2, r3 = rows[0], rows[1], rows[2], rows[3]
    inverse = rows[BLOCK]
    finite = True
    if flags[QUANT]:
        for j in range(dim):
            key = _order_key(bits[start, j])
            low_keys[j] = key
            high_keys[j] = key
    for block in range(start, stop, BLOCK):
        count = min(BLOCK, stop - block)
        for k in range(BLOCK):
            row = rows[k]
            if k >= count:  # a short last block: zero rows add nothing to any sum
                for j in range(dim):
                    row[j] = 0.0
                inverse[k] = 0.0
                continue
            i = block + k
            values = x[i]
            row_bits = bits[i]
            square_sum = 0.0
            peak = 0
            for j in range(dim):  # the row's peak in the same loop (a second reduction)
                v = np.float64(values[j])
                row[j] = v
                square_sum += v * v
                a = row_bits[j] & ABS_MASK
                peak = a if a > peak else peak
            if not np.isfinite(square_sum):
                finite = False
            scalars[SQUARE_SUM] += square_sum
            square_norms[i] = square_sum
            if flags[QUANT]:
                for j in range(dim):
                    key = _order_key(row_bits[j])
                    low = low_keys[j]
                    low_keys[j] = low + ((key - low) & -(key < low))
                for j in range(dim):
                    key = _order_key(row_bits[j])
                    high = high_keys[j]
                    high_keys[j] = high + ((key - high) & -(key > high))
            if flags[CHANNELS]:
                peak_bits[i] = peak
            if flags[NORMS]:
                norm = np.sqrt(square_sum)
                scalars[NORM_SUM] += norm
                scalars[NORM_MIN] = min(scalars[NORM_MIN], norm)
                scalars[NORM_MAX] = max(scalars[NORM_MAX], norm)
                inverse[k] = 1.0 / max(norm, 1e-30)
        # Per channel, once per block. One array written per loop: LLVM vectorizes a loop only
        # when it can check at run time that what it writes does not overlap what it reads.
        if flags[MEAN]:
            for j in range(dim):
                sums[j] += (r0[j] + r1[j]) + (r2[j] + r3[j])
        if flags[CHANNELS]:
            last = block + count - 1  # a short block repeats its last row: the same maximum
            b0, b1 = bits[block], bits[min(block + 1, last)]
            b2, b3 = bits[min(block + 2, last)], bits[min(block + 3, last)]
            for j in range(dim):
                a = b0[j] & ABS_MASK
                b = b1[j] & ABS_MASK
                c = b2[j] & ABS_MASK
                d = b3[j] & ABS_MASK
                a = a + ((b - a) & -(b > a))
                c = c + ((d - c) & -(d > c))
                a = a + ((c - a) & -(c > a))
                m = absmax_bits[j]
                absmax_bits[j] = m + ((a - m) & -(a > m))
            for j in range(dim):
                a, b, c, d = r0[j], r1[j], r2[j], r3[j]
                power1[j] += (a * a + b * b) + (c * c + d * d)
            for j in range(dim):
                a, b, c, d = r0[j], r1[j], r2[j], r3[j]
                power2[j] += (a * a * a + b * b * b) + (c * c * c + d * d * d)
            for j in range(dim):
                a, b, c, d = r0[j] * r0[j], r1[j] * r1[j], r2[j] * r2[j], r3[j] * r3[j]
                power3[j] += (a * a + b * b) + (c * c + d * d)
        if flags[ROPE]:
            for p in range(first.shape[0]):
                f, s = first[p], second[p]
                band[p] += ((r0[f] * r0[f] + r0[s] * r0[s]) + (r1[f] * r1[f] + r1[s] * r1[s])) + (
                    (r2[f] * r2[f] + r2[s] * r2[s]) + (r3[f] * r3[f] + r3[s] * r3[s])
                )
        if flags[NORMS]:
            i0, i1, i2, i3 = inverse[0], inverse[1], inverse[2], inverse[3]
            for j in range(dim):
                unit_sum[j] += (r0[j] * i0 + r1[j] * i1) + (r2[j] * i2 + r3[j] * i3)
    return finite


def _order_key(bits: int) -> int:
    """An int32 key of a float32's bits that orders as the float does (-0 just below +0):
    negative floats have their magnitude bits flipped. The map is its own inverse."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _quant_tile(
    x: np.ndarray,
    start: int,
    stop: int,
    low_keys: np.ndarray,
    high_keys: np.ndarray,
    levels: np.ndarray,
    token: np.ndarray,
    channel: np.ndarray,
    scratch: np.ndarray,
    groups: np.ndarray,
) -> None:
    """Add the squared min-max quantization errors of rows ``start:stop`` (one group of at most
    `GROUP` tokens; ``low_keys``/``high_keys`` ``(dim,)``: its channel minima and maxima as order
    keys) at the three ``levels`` (float32): per token in groups of `GROUP` channels to ``token``
    ``(3,)``, per channel to ``channel`` ``(3,)``. ``scratch``: ``(14, dim)`` float32;
    ``groups``: ``(8, GROUP * ceil(dim / GROUP))`` float32.

    The three widths of one value are computed in one loop. The token groups' minima, maxima,
    steps and reciprocals come first, for every row of the tile (the divisions then run one
    after another instead of each waiting for its group's minimum), then the errors."""
    dim = x.shape[1]
    one = np.float32(1.0)
    lows = scratch[0]
    low_bits = lows.view(np.int32)
    high_bits = scratch[1].view(np.int32)
    for j in range(dim):
        low_bits[j] = _order_key(low_keys[j])
        high_bits[j] = _order_key(high_keys[j])
    highs = scratch[1]
    steps = scratch[2:5]
    inverses = scratch[5:8]
    channel_errors = scratch[8:11]
    for b in range(3):
        level = levels[b]
        step_b = steps[b]
        inverse_b = inverses[b]
        for j in range(dim):
            spread = highs[j] - lows[j]
            step = spread / level if spread > 0 else one
            step_b[j] = step
            inverse_b[j] = one / step
    channel_errors[:] = 0
    token_errors = scratch[11:14]
    token_errors[:] = 0
    s0, s1, s2 = steps[0], steps[1], steps[2]
    i0, i1, i2 = inverses[0], inverses[1], inverses[2]
    c0, c1, c2 = channel_errors[0], channel_errors[1], channel_errors[2]
    t0, t1, t2 = token_errors[0], token_errors[1], token_errors[2]
    l0, l1, l2 = levels[0], levels[1], levels[2]
    full = dim - dim % GROUP
    per_row = (dim + GROUP - 1) // GROUP
    group_low, group_high = groups[0], groups[1]
    step0, step1, step2 = groups[2], groups[3], groups[4]
    inverse0, inverse1, inverse2 = groups[5], groups[6], groups[7]
    for i in range(start, stop):
        row = x[i]
        for g in range(0, dim, GROUP):
            size = GROUP if g < full else dim - full
            group = row[g : g + size]
            low = group[0]
            high = group[0]
            for j in range(size):
                v = group[j]
                low = v if v < low else low
                high = v if v > high else high
            p = (i - start) * per_row + g // GROUP
            group_low[p] = low
            group_high[p] = high
    for p in range((stop - start) * per_row):
        spread = group_high[p] - group_low[p]
        positive = spread > 0
        step = spread / l0 if positive else one
        step0[p] = step
        inverse0[p] = one / step
        step = spread / l1 if positive else one
        step1[p] = step
        inverse1[p] = one / step
        step = spread / l2 if positive else one
        step2[p] = step
        inverse2[p] = one / step
    for i in range(start, stop):
        row = x[i]
        for j in range(dim):
            v = row[j]
            low = lows[j]
            d = v - low
            e0 = (np.rint(d * i0[j]) * s0[j] + low) - v
            e1 = (np.rint(d * i1[j]) * s1[j] + low) - v
            e2 = (np.rint(d * i2[j]) * s2[j] + low) - v
            c0[j] += e0 * e0
            c1[j] += e1 * e1
            c2[j] += e2 * e2
        for g in range(0, dim, GROUP):
            size = GROUP if g < full else dim - full
            group = row[g : g + size]
            p = (i - start) * per_row + g // GROUP
            low = group_low[p]
            st0, st1, st2 = step0[p], step1[p], step2[p]
            in0, in1, in2 = inverse0[p], inverse1[p], inverse2[p]
            a0, a1, a2 = t0[g : g + size], t1[g : g + size], t2[g : g + size]
            for j in range(size):
                v = group[j]
                d = v - low
                e0 = (np.rint(d * in0) * st0 + low) - v
                e1 = (np.rint(d * in1) * st1 + low) - v
                e2 = (np.rint(d * in2) * st2 + low) - v
                a0[j] += e0 * e0
                a1[j] += e1 * e1
                a2[j] += e2 * e2
    for b in range(3):
        total = 0.0
        for j in range(dim):
            total += np.float64(channel_errors[b, j])
        channel[b] += total
        total = 0.0
        for j in range(dim):
            total += np.float64(token_errors[b, j])
        token[b] += total


def _accumulate(
    x: np.ndarray,
    bits: np.ndarray,
    positions: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    levels: np.ndarray,
    flags: np.ndarray,
    scalars: np.ndarray,
    norm_hist: np.ndarray,
    peak_hist: np.ndarray,
    sums: np.ndarray,
    power: np.ndarray,
    absmax_bits: np.ndarray,
    unit_sum: np.ndarray,
    band: np.ndarray,
    position_count: np.ndarray,
    position_norm: np.ndarray,
    peak_bits: np.ndarray,
    square_norms: np.ndarray,
    quant_token: np.ndarray,
    quant_channel: np.ndarray,
    edges: np.ndarray,
    guesses: np.ndarray,
) -> None:
    """Update the sums with ``x`` ``(n_tokens, dim)`` float32 (``bits``: its int32 view) at
    ``positions`` ``(n_tokens,)``, for the groups ``flags`` selects, one tile of `GROUP` rows
    at a time (the row pass, then the quantization pass on the same tile).

        ``scalars`` (`SCALARS`,): sum ||x||, sum ||x||^2, min ||x||, max ||x||, sum ||x_0||,
        count of x_0 (slots `NORM_SUM` ... `FIRST_COUNT`);
        ``absmax_bits`` ``(dim,)`` int32: the float32 bits of each channel's max |x| so far;
        ``peak_bits`` ``(n_tokens,)`` int32 receives each row's max |x| as float32 bits, and
        ``peak_hist`` counts them (CHANNELS); ``sums`` ``(dim,)`` receives this piece's channel
        sums, also added to ``power[0]`` (MEAN);
        ``square_norms`` ``(n_tokens,)`` float64 receives each row's ||x||^2;
        ``quant_token``, ``quant_channel`` ``(3,)``: the error sums at 8, 4 and 2 bits;
        ``edges``, ``guesses``: `hist_edges()` and `hist_guesses()`."""
    n, dim = x.shape
    rows = np.empty((BLOCK + 1, max(dim, BLOCK)), np.float64)
    low_keys = np.empty(dim, np.int32)
    high_keys = np.empty(dim, np.int32)
    scratch = np.empty((14, dim), np.float32)
    groups = np.empty((8, GROUP * ((dim + GROUP - 1) // GROUP)), np.float32)
    levels32 = levels.astype(np.float32)
    nan = False
    for start in range(0, n, GROUP):
        stop = min(start + GROUP, n)
        finite = _row_pass(
            x,
            bits,
            start,
            stop,
            positions,
            first,
            second,
            flags,
            scalars,
            norm_hist,
            power,
            absmax_bits,
            unit_sum,
            band,
            position_count,
            position_norm,
            peak_bits,
            square_norms,
            low_keys,
            high_keys,
            rows,
            sums,
        )
        if flags[QUANT]:
            if finite:
                _quant_tile(
                    x, start, stop, low_keys, high_keys, levels32, quant_token, quant_channel, scratch, groups
                )
            else:
                nan = True
    if nan:
        quant_token[:] = np.nan
        quant_channel[:] = np.nan
    if flags[MEAN]:
        for j in range(dim):
            power[0, j] += sums[j]
    values = np.empty(n, np.float64)
    if flags[NORMS]:
        # Per row, after the row pass (a logarithm in its loop would spill its vector registers
        # at every call): the norm's histogram bin and its position bin, ``floor(log2 p) + 1``
        # read off the exponent of ``p`` as a float64 (exact below 2^53), the last bin holding
        # everything beyond; position 0 also adds to the first-token sums.
        for i in range(n):
            values[i] = np.sqrt(square_norms[i])
        _hist_bins(values, edges, guesses, norm_hist)
        bins = position_count.shape[0]
        exponents = positions.astype(np.float64).view(np.int64)
        for i in range(n):
            position = positions[i]
            norm = values[i]
            slot = 0
            if position > 0:
                slot = min((exponents[i] >> 52) - 1023 + 1, bins - 1)
            elif position == 0:
                scalars[FIRST_NORM_SUM] += norm
                scalars[FIRST_COUNT] += 1.0
            position_count[slot] += 1
            position_norm[slot] += norm
    if flags[CHANNELS]:
        peaks = peak_bits.view(np.float32)
        for i in range(n):
            values[i] = np.float64(peaks[i])
        _hist_bins(values, edges, guesses, peak_hist)


def _top_rows(peak_bits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``min(k, n)`` rows with the largest peaks, unordered (``peak_bits``
    ``(n,)``: non-negative float32 bits as int32, which order as the floats do); among equal
    peaks the later rows, as the catalogue's (value, position) order ranks them. One pass with
    a running minimum: O(n) for all but adversarial inputs, where it is O(n k)."""
    n = peak_bits.shape[0]
    m = min(k, n)
    best = np.empty(m, np.int64)
    if m == 0:
        return best
    lowest = 0
    for i in range(m):
        best[i] = i
        if peak_bits[i] <= peak_bits[best[lowest]]:
            lowest = i
    floor = peak_bits[best[lowest]]
    for i in range(m, n):
        if peak_bits[i] >= floor:  # ties: the later row ranks higher
            best[lowest] = i
            lowest = 0
            for s in range(1, m):
                a, b = peak_bits[best[s]], peak_bits[best[lowest]]
                if a < b or (a == b and best[s] < best[lowest]):
                    lowest = s
            floor = peak_bits[best[lowest]]
    return best


def _add_shift_terms(gram: np.ndarray, center: np.ndarray, sums: np.ndarray, n: int) -> None:
    """``gram += c s^T + s c^T - n c c^T`` (float64; ``c`` = ``center``): what turns the Gram
    matrix of rows less ``c`` into that of the rows, ``s`` their sum."""
    dim = gram.shape[0]
    for i in range(dim):
        ci = np.float64(center[i])
        for j in range(dim):
            cj = np.float64(center[j])
            gram[i, j] += ci * sums[j] + sums[i] * cj - n * ci * cj


def _heavy_rows(square_norms: np.ndarray, factor: float) -> np.ndarray:
    """Rows whose squared norm exceeds ``factor`` times the median (``(n,)`` bool)."""
    return square_norms > factor * np.median(square_norms)


# Reassociation lets LLVM vectorize the float64 reductions of the row pass (sums move by ~1e-15
# relative); it keeps NaN semantics, so non-finite rows are seen. The quantization pass keeps the
# order of its float32 arithmetic (no reassociation, no fused multiply-add: each error rounds as
# the numpy definition's does) and adds no-NaN/no-inf so that its min/max reductions vectorize;
# it is only called on finite tiles.
_ROW_FLAGS = {"reassoc", "nsz", "contract"}
_QUANT_FLAGS = {"nsz", "nnan", "ninf"}
if numba is not None:
    _hist_bins = numba.njit(cache=True, nogil=True)(_hist_bins)
    _row_pass = numba.njit(cache=True, nogil=True, fastmath=_ROW_FLAGS)(_row_pass)
    _order_key = numba.njit(cache=True, nogil=True, inline="always")(_order_key)
    _quant_tile = numba.njit(cache=True, nogil=True, fastmath=_QUANT_FLAGS)(_quant_tile)
    accumulate = numba.njit(cache=True, nogil=True)(_accumulate)
    heavy_rows = numba.njit(cache=True, nogil=True)(_heavy_rows)
    top_rows = numba.njit(cache=True, nogil=True)(_top_rows)
    add_shift_terms = numba.njit(cache=True, nogil=True)(_add_shift_terms)
elif native.AVAILABLE:
    accumulate = native.accumulate
    heavy_rows = _heavy_rows  # numpy's median: nothing to compile
    top_rows = native.top_rows
    add_shift_terms = native.add_shift_terms
else:  # pragma: no cover
    accumulate = _accumulate
    heavy_rows = _heavy_rows
    top_rows = _top_rows
    add_shift_terms = _add_shift_terms
