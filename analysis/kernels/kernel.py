"""The fused compiled kernel behind `HeadAccumulator.add` (`kernels.c`, loaded by `analysis.kernels.native`).

One call walks a piece of rows ``(n_tokens, dim)`` float32 in tiles of `GROUP` rows (16 KiB for
128 channels, so a tile stays in L1) and updates, for the statistic groups asked for, every
per-element sum of the catalogue in place:

- the row pass (float64 sums): squared norms, channel power sums up to the 4th
  order, channel absmax and the per-row peak, the unit-vector sum, RoPE pair energy;
- the quantization pass (float32 arithmetic as the definition says): min-max
  quantization error at 8/4/2 bits in groups of `GROUP` channels per token and `GROUP` tokens per
  channel, both over the tile the row pass has just read.

After the tiles, per row: the log histogram bins of the norm and of the peak (exact edges and a
guess from the float's top bits, no logarithm: a ``log10`` call inside the row pass costs twice
as much and spills its vector registers) and the norm-by-position bin (read off the position's
float64 exponent).

The Gram matrix stays with BLAS (`compiled`). Every inner loop runs over contiguous
channels without a loop-carried dependency other than a reduction, so the compiler vectorizes it:
the float64 sums are reassociated, the absolute maxima are taken on the float
bits as integers (an exact, vectorizable max for non-negative floats), and the quantization pass,
which alone runs with no-NaN fast math, only sees tiles the row pass found finite (a non-finite
tile makes the quantization errors NaN, as the numpy reference would). A value's level is
``rint((v - low) * (1 / step))`` with the reciprocal rounded to float32 first, as the
definition (`catalogue.quant_error`) takes it: the levels equal the reference's, ties
included; the sums agree with it to ~1e-8 relative (their order differs).

Where the library is not built (no C compiler at install), or ``KVSNAP_KERNEL=numpy`` is in the
environment, `AVAILABLE` is false and the numpy reference (`kernels.reference`) runs instead.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from ..stats.catalogue import hist_edges as edges
from ..stats.catalogue import hist_index
from . import native
from .native import accumulate, add_shift_terms, running_sums, settings, top_rows

__all__ = [
    "AVAILABLE",
    "accumulate",
    "add_shift_terms",
    "heavy_rows",
    "hist_edges",
    "hist_guesses",
    "running_sums",
    "settings",
    "top_rows",
]

SELECTED = os.environ.get("KVSNAP_KERNEL", "compiled")  # compiled (C, where built) or numpy

AVAILABLE = SELECTED != "numpy" and native.AVAILABLE

ABS_MASK = np.int32(0x7FFFFFFF)

# Flags (an int64 array, so one compiled version serves every selection).
NORMS, CHANNELS, ROPE, MEAN, QUANT = range(5)
FLAGS = 5

# Slots of the ``scalars`` float64 array the kernel updates.
NORM_SUM, SQUARE_SUM, NORM_MIN, NORM_MAX, FIRST_NORM_SUM, FIRST_COUNT = range(6)
SCALARS = 6

BLOCK = 4  # rows whose per-channel sums the row pass adds together


def hist_edges() -> np.ndarray:
    """``(BINS + 1,)`` float64 bin edges of the log histogram (`catalogue.hist_edges`)."""

    return edges(np.float64)


GUESS_SHIFT = 45  # a float64's exponent and top 7 mantissa bits: cells of 2^-7 relative width


@functools.cache
def hist_guesses() -> np.ndarray:
    """``(cells,)`` int64: the `hist_index` bin of the smallest float64 of each cell of the
    float64s from `hist_edges()[1]` to ``[-2]`` (a cell: the values sharing their bits above bit
    `GUESS_SHIFT`, 0.8% relative width against a bin's 1.8%), index 0 the cell of
    `hist_edges()[1]`: a value's first guess, within a bin of its own."""

    edges = hist_edges()
    first = int(edges[1:2].view(np.int64)[0]) >> GUESS_SHIFT
    last = int(edges[-2:-1].view(np.int64)[0]) >> GUESS_SHIFT
    starts = (np.arange(first, last + 1, dtype=np.int64) << GUESS_SHIFT).view(np.float64)
    return hist_index(starts)


def heavy_rows(square_norms: np.ndarray, factor: float) -> np.ndarray:
    """Rows whose squared norm exceeds ``factor`` times the median (``(n,)`` bool)."""
    return square_norms > factor * np.median(square_norms)
