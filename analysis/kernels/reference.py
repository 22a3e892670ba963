"""The numpy reference backend: every sum written out plainly in float64, a piece of `PIECE` rows
at a time. Slow and obviously right: the other backends are tested against it, and it runs
where the C kernels are not built."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvformat.checksum import crc32c

from ..stats.catalogue import BINS, POSITION_BINS, QUANT_BITS, TOP_K, hist_index, position_bins, quant_error
from .arrays import PIECE, bytes_of

if TYPE_CHECKING:
    from kvformat import PayloadCheck

    from ..stats.sums import RunningSums

NAME = "numpy"


def available() -> bool:
    return True


def add(acc: RunningSums, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None) -> None:
    """Add ``rows`` ``(n_tokens, dim)`` at ``positions`` ``(n_tokens,)`` to ``acc``, after checking
    their CRC against ``check`` (if given); rows holding an inf or NaN are left out and counted."""
    acc.prepare_add()
    if check is not None:
        check.check(crc32c(bytes_of(rows)))
    rows, positions = acc.drop_nonfinite(rows, positions)
    _add(acc, rows, positions)
    acc.add_added(rows, positions)


def _add(acc: RunningSums, rows: np.ndarray, positions: np.ndarray) -> None:
    for start in range(0, rows.shape[0], PIECE):
        x = np.asarray(rows[start : start + PIECE], dtype=np.float64)
        pos = positions[start : start + PIECE]
        if not x.shape[0]:
            continue
        x2 = x * x
        sq = x2.sum(axis=1)
        norms = np.sqrt(sq)
        acc.count += x.shape[0]
        acc.norm_sum += float(norms.sum())
        acc.norm_sq_sum += float(sq.sum())
        acc.norm_min = min(acc.norm_min, float(norms.min()))
        acc.norm_max = max(acc.norm_max, float(norms.max()))
        acc.norm_hist += np.bincount(hist_index(norms), minlength=BINS)
        magnitude = np.abs(x)
        peaks = magnitude.max(axis=1)
        acc.peak_hist += np.bincount(hist_index(peaks), minlength=BINS)
        acc.absmax = np.maximum(acc.absmax, magnitude.max(axis=0))
        del magnitude
        acc.power[0] += x.sum(0)
        acc.power[1] += x2.sum(0)
        acc.power[2] += np.einsum("ij,ij->j", x2, x)
        acc.power[3] += np.einsum("ij,ij->j", x2, x2)
        del x2
        if "spectrum" in acc.groups:
            acc.gram += x.T @ x
        acc.unit_sum += (1.0 / np.maximum(norms, 1e-30)) @ x
        if acc.band is not None and acc.rope is not None:
            acc.band += acc.rope.pair_energy(x)
        if pos.size and pos[0] == 0:
            acc.first_norm_sum += float(norms[0])
            acc.first_count += 1
        bins = position_bins(np.asarray(pos))
        acc.position_count += np.bincount(bins, minlength=POSITION_BINS)
        acc.position_norm += np.bincount(bins, weights=norms, minlength=POSITION_BINS)
        best = np.lexsort((np.asarray(pos), peaks))[-TOP_K:]  # among equal peaks, the later positions
        acc.top = sorted(acc.top + [(float(peaks[i]), int(pos[i])) for i in best], reverse=True)[:TOP_K]
        x32 = np.asarray(rows[start : start + PIECE], dtype=np.float32)
        for i, bits in enumerate(QUANT_BITS):
            acc.quant_token[i] += quant_error(x32, bits, axis=1)
            acc.quant_channel[i] += quant_error(x32, bits, axis=0)
