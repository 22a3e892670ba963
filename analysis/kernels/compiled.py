"""The CPU backend: the fused compiled kernel (`kernel`: C, `analysis.kernels.native`), a few calls per
piece of `KERNEL_ROWS` rows, plus the Gram matrix through BLAS. Chosen by ``backend="cpu"`` where
the library is built (`reference` otherwise)."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import numpy as np

from kvformat.checksum import crc32c

from ..stats import finite
from ..stats.catalogue import LEVELS, TOP_K
from . import kernel
from .arrays import GRAM_FLOAT64_ROWS, GRAM_ROWS, HEAVY, KERNEL_ROWS, bytes_of, float32_rows, work_buffer

if TYPE_CHECKING:
    from kvformat import PayloadCheck

    from ..stats.rope import Rope
    from ..stats.sums import RunningSums

NAME = "cpu"
GEMM_ROWS = 64
"""Pieces of up to this many rows take their float64 Gram product as a general product, which is
faster than numpy's symmetric rank-k update on so few rows (`python -m benchmarks.kernel_bench`)."""
_NO_PAIRS = np.empty(0, np.int64)


def available() -> bool:
    """Whether the C kernels (and so this backend) are built here."""
    return bool(kernel.AVAILABLE)


def add(acc: RunningSums, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None) -> None:
    """Add ``rows`` ``(n_tokens, dim)`` at ``positions`` ``(n_tokens,)`` to ``acc``. ``check``: the
    CRC ``rows`` (a chunk's whole payload, read unchecked) must have; each piece is checksummed just
    before the kernel reads it (so it is read from memory once) and a mismatch raises
    `kvformat.ChecksumError` once the rows are added: ``acc`` is then to be dropped. Rows holding
    an inf or NaN are left out and counted."""
    # Rows whose CRC is still pending: a damaged chunk stops the pass with its ChecksumError
    # alone, not with numpy's warnings about the garbage it held.
    quiet = np.errstate(invalid="ignore", over="ignore", divide="ignore")
    acc.prepare_add()
    with quiet if check is not None else contextlib.nullcontext():
        _add(acc, rows, positions, check)
    acc.add_added(rows, positions)


@functools.cache
def _flags(groups: frozenset[str], has_band: bool) -> np.ndarray:
    """The kernel's work flags for a selection of statistic groups."""
    flags = np.zeros(kernel.FLAGS, np.int64)
    flags[kernel.NORMS] = "norms" in groups
    flags[kernel.CHANNELS] = "channels" in groups
    flags[kernel.ROPE] = "rope" in groups and has_band
    flags[kernel.MEAN] = "channels" in groups or "spectrum" in groups
    flags[kernel.QUANT] = "quant" in groups
    flags.flags.writeable = False
    return flags


def _add(
    acc: RunningSums, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None
) -> None:
    # Few Python-level calls per piece: with many threads, what holds the GIL sets the pace.
    settings = _settings(acc.groups, acc.rope if acc.band is not None else None)
    channels, spectrum = "channels" in acc.groups, "spectrum" in acc.groups
    scalars = np.zeros(kernel.SCALARS)
    scalars[kernel.NORM_MIN], scalars[kernel.NORM_MAX] = acc.norm_min, acc.norm_max
    absmax_bits = np.zeros(acc.dim, np.int32)
    running = kernel.running_sums(acc, settings, scalars, absmax_bits)
    sums = np.zeros(acc.dim)
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    crc = 0
    for start in range(0, rows.shape[0], KERNEL_ROWS):
        if check is not None:
            crc = crc32c(bytes_of(rows[start : start + KERNEL_ROWS]), crc)
        x = float32_rows(rows[start : start + KERNEL_ROWS], reuse=True, compiled=True)
        pos = positions[start : start + x.shape[0]]
        if finite.any_nonfinite(x):  # cache-hot: the kernel reads the piece next
            x, pos = acc.drop_nonfinite(x, pos)
            x = np.ascontiguousarray(x)
        n = x.shape[0]
        if not n:
            continue
        peak_bits = np.empty(n, np.int32)
        square_norms = np.empty(n)
        sums[:] = 0.0
        kernel.accumulate(x, pos, peak_bits, square_norms, sums, settings, running)
        if spectrum:
            _add_gram(acc, x, sums, square_norms)
        acc.count += n
        if channels:
            _add_top(acc, peak_bits, pos)
    _fold_scalars(acc, scalars, absmax_bits if channels else None)
    if check is not None:
        check.check(crc)


@functools.lru_cache(maxsize=64)
def _settings(groups: frozenset[str], rope: Rope | None) -> kernel.native.Settings:
    """The kernel's settings for a selection of statistic groups and, where the accumulator keeps
    a RoPE band, its ``rope`` (the pairs' channel indices: first, second); made once for each."""
    first, second = rope.pair_indices() if rope is not None else (_NO_PAIRS, _NO_PAIRS)
    return kernel.settings(
        first=first,
        second=second,
        levels=LEVELS,
        flags=_flags(groups, rope is not None),
        edges=kernel.hist_edges(),
        guesses=kernel.hist_guesses(),
    )


def _add_top(acc: RunningSums, peak_bits: np.ndarray, positions: np.ndarray) -> None:
    """Merge a piece's `TOP_K` largest row peaks (``peak_bits`` ``(n,)``, float32 bits) into the
    accumulator's top list."""
    best = kernel.top_rows(peak_bits, TOP_K).tolist()
    peaks = peak_bits.view(np.float32)
    acc.top = sorted(acc.top + [(float(peaks[i]), int(positions[i])) for i in best], reverse=True)[:TOP_K]


def _fold_scalars(acc: RunningSums, scalars: np.ndarray, absmax_bits: np.ndarray | None) -> None:
    """The kernel's scalar sums (`kernel.SCALARS`) and channel maxima (float32 bits; None where
    channels were not asked for) into the accumulator."""
    if absmax_bits is not None:
        acc.absmax = np.maximum(acc.absmax, absmax_bits.view(np.float32))
    acc.norm_sum += float(scalars[kernel.NORM_SUM])
    acc.norm_sq_sum += float(scalars[kernel.SQUARE_SUM])
    acc.norm_min, acc.norm_max = float(scalars[kernel.NORM_MIN]), float(scalars[kernel.NORM_MAX])
    acc.first_norm_sum += float(scalars[kernel.FIRST_NORM_SUM])
    acc.first_count += int(scalars[kernel.FIRST_COUNT])


def _add_gram(acc: RunningSums, x: np.ndarray, sums: np.ndarray, square_norms: np.ndarray) -> None:
    """Add ``x`` ``(n, dim)`` float32 (channel sums ``sums`` float64, row norms squared
    ``square_norms``) to the Gram matrix.

    Pieces under `GRAM_FLOAT64_ROWS` rows are added in float64. In larger ones, rows over
    `HEAVY` times the piece's median squared norm (massive activations, attention
    sinks) are added in float64: in float32 they would set the rounding of every entry. The
    others run in float32 (BLAS) less their mean ``c``, so rounding is relative to their
    spread, in pieces of `GRAM_ROWS` added in float64:
    ``sum x x^T = sum (x-c)(x-c)^T + c s^T + s c^T - n c c^T`` with ``s = sum x``."""
    if x.shape[0] < GRAM_FLOAT64_ROWS:  # small pieces: float64 costs nothing there
        x64 = x.astype(np.float64)
        if x.shape[0] <= GEMM_ROWS:  # BLAS's syrk (numpy's x.T @ x) is slower on so few rows
            acc.gram += np.ascontiguousarray(x64.T) @ x64
        else:
            acc.gram += x64.T @ x64
        return
    heavy = kernel.heavy_rows(square_norms, HEAVY)
    n = x.shape[0]
    any_heavy = bool(heavy.any())
    if any_heavy:
        big = x[heavy].astype(np.float64)
        acc.gram += big.T @ big
        sums = sums - big.sum(axis=0)
        n -= big.shape[0]
    if not n:
        return
    center = (sums / n).astype(np.float32)  # the shift; exact shifts are not needed
    # Per GRAM_ROWS-row piece: the shift into this thread's buffer (heavy rows zeroed:
    # they were added above), then ``piece.T @ piece``, which numpy computes with BLAS's
    # symmetric rank-k update (syrk: half the multiplications of a general product). Large
    # numpy calls release the GIL; the buffer stays in cache and costs no page faults.
    for start in range(0, x.shape[0], GRAM_ROWS):
        rows = x[start : start + GRAM_ROWS]
        piece = work_buffer("gram", rows.shape[0], rows.shape[1])
        np.subtract(rows, center, out=piece)
        if any_heavy:
            piece[heavy[start : start + GRAM_ROWS]] = 0.0
        acc.gram += piece.T @ piece
    kernel.add_shift_terms(acc.gram, center, sums, n)
