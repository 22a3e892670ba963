"""Per-head statistics of K and V, computed in one streaming pass over a snapshot's chunks.

One accumulator per (sequence, layer, head, tensor) holds mergeable sums only (moments, a Gram
matrix, histograms, a top-k list), so memory is bounded by ``head_dim^2`` per head, never by the
number of tokens, and accumulators of different chunks or files merge exactly. The formulas are in
``analysis/README.md``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import kvformat
from kvsnap.analysis import kernel
from kvsnap.analysis.eigen import eigenvalues
from kvsnap.analysis.rope import Rope
from kvsnap.analysis.tokens import token_ids, token_pieces

if TYPE_CHECKING:
    import polars as pl
    import pyarrow as pa

_LOG_LOW, _LOG_HIGH, _BINS = -8.0, 8.0, 2048  # log10 histogram: ~1.8% relative bin width
_PIECE = 1 << 13
_NO_PAIRS = np.empty(0, np.int64)
_NO_BAND = np.empty(0)
_GRAM_ROWS = 512  # rows per float32 product: its rounding grows with them
_BATCH_BYTES = 8 << 20  # K + V bytes of one head handed to one task
_GRAM_FLOAT64_ROWS = 512  # fewer rows than this: the Gram update in float64
_HEAVY = 16.0  # squared norm over the piece's median: a row the Gram adds in float64
TOP_K = 8
QUANT_BITS = (8, 4, 2)
_LEVELS = np.array([(1 << bits) - 1 for bits in QUANT_BITS], np.int64)
QUANT_GROUP = 32
POSITION_BINS = 48  # [0,1), [1,2), [2,4), ... [2^46, 2^47)
RANKS = (1, 4, 16)


def _hist_index(values: np.ndarray) -> np.ndarray:
    logs = np.log10(np.maximum(values, 10.0**_LOG_LOW))
    scaled = (logs - _LOG_LOW) / (_LOG_HIGH - _LOG_LOW) * _BINS
    return np.clip(scaled.astype(np.int64), 0, _BINS - 1)


def _hist_quantile(hist: np.ndarray, q: float) -> float:
    total = hist.sum()
    if not total:
        return float("nan")
    index = int(np.searchsorted(np.cumsum(hist), q * total, side="left"))
    center = _LOG_LOW + (index + 0.5) * (_LOG_HIGH - _LOG_LOW) / _BINS
    return float(10.0**center)


def _group_error(groups: np.ndarray, levels: int, axis: int) -> float:
    """Squared error of min-max quantizing ``groups`` to ``levels`` steps along ``axis``."""
    low = groups.min(axis=axis, keepdims=True)
    high = groups.max(axis=axis, keepdims=True)
    step = np.where(high > low, (high - low) / levels, np.float32(1.0))
    restored = np.round((groups - low) / step) * step + low
    restored -= groups
    np.square(restored, out=restored)
    return float(restored.sum(dtype=np.float64))


def _quant_error(x: np.ndarray, bits: int, axis: int) -> float:
    """Sum of squared errors of asymmetric min-max quantization in groups of `QUANT_GROUP`
    along ``axis`` (1: per-token groups of channels; 0: per-channel groups of tokens); a last
    partial group is quantized on its own. ``x``: ``(n_tokens, dim)`` float32 (computed in
    float32, summed in float64)."""
    levels = (1 << bits) - 1
    n, dim = x.shape
    if axis == 1:
        full = dim - dim % QUANT_GROUP
        error = _group_error(x[:, :full].reshape(n, -1, QUANT_GROUP), levels, 2) if full else 0.0
        return error + (_group_error(x[:, full:], levels, 1) if full < dim else 0.0)
    full = n - n % QUANT_GROUP
    error = _group_error(x[:full].reshape(-1, QUANT_GROUP, dim), levels, 1) if full else 0.0
    return error + (_group_error(x[full:], levels, 0) if full < n else 0.0)


def _float32(rows: np.ndarray) -> np.ndarray:
    """``rows`` as a C-contiguous float32 array: a view for float32, else one conversion
    (bfloat16 by shifting its bits into the high half of a float32)."""
    if rows.dtype == np.float32:
        return np.ascontiguousarray(rows)
    if rows.dtype.name == "bfloat16":
        bits = np.ascontiguousarray(rows).view(np.uint16).astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    return np.ascontiguousarray(rows, dtype=np.float32)


GROUPS: dict[str, tuple[str, ...]] = {
    "norms": (
        "norm_mean",
        "norm_std",
        "norm_min",
        "norm_max",
        "norm_p50",
        "norm_p99",
        "norm_sq_mean",
        "sink_ratio",
        "norm_by_position",
        "anisotropy",
    ),
    "channels": (
        "channel_mean",
        "channel_var",
        "channel_absmax",
        "outlier_channel_ratio",
        "channel_kurtosis",
        "massive_positions",
        "massive_values",
        "massive_ratio",
    ),
    "rope": ("rope_band_energy",),
    "spectrum": ("eigenvalues", "rank_90", "effective_rank", *(f"rank{r}_error" for r in RANKS)),
    "quant": tuple(f"quant{b}_{axis}_error" for b in QUANT_BITS for axis in ("token", "channel")),
}
"""The statistic groups and their columns (``n_tokens`` is always there)."""

ALL = frozenset(GROUPS)


def stat_groups(stats: str | Iterable[str] | None = None) -> frozenset[str]:
    """The groups named by ``stats``: ``None`` or ``"all"`` for every group, else names from
    `GROUPS` (a comma-separated string or an iterable); ValueError naming an unknown group."""
    if stats is None:
        return ALL
    names = [s.strip() for s in stats.split(",")] if isinstance(stats, str) else [str(s) for s in stats]
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"no statistic group named; choose from all, {', '.join(GROUPS)}")
    if "all" in names:
        return ALL
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise ValueError(f"unknown statistic group {unknown[0]!r}; choose from all, {', '.join(GROUPS)}")
    return frozenset(names)


@dataclass
class HeadAccumulator:
    """Mergeable sums for one (sequence, layer, head, tensor) over vectors of ``dim`` channels,
    for the statistic ``groups`` (see `GROUPS`; all by default)."""

    dim: int
    rope: Rope | None = None
    groups: frozenset[str] = ALL
    count: int = 0
    norm_sum: float = 0.0
    norm_sq_sum: float = 0.0
    norm_min: float = float("inf")
    norm_max: float = float("-inf")
    norm_hist: np.ndarray = field(default_factory=lambda: np.zeros(_BINS, np.int64))
    peak_hist: np.ndarray = field(default_factory=lambda: np.zeros(_BINS, np.int64))
    power: np.ndarray = field(init=False)  # (4, dim) sums of x, x^2, x^3, x^4
    absmax: np.ndarray = field(init=False)
    gram: np.ndarray = field(init=False)  # (dim, dim) sum of x x^T
    unit_sum: np.ndarray = field(init=False)
    band: np.ndarray | None = field(init=False)
    first_norm_sum: float = 0.0  # ||x|| at position 0, summed over the sequences that hold it
    first_count: int = 0
    position_count: np.ndarray = field(default_factory=lambda: np.zeros(POSITION_BINS, np.int64))
    position_norm: np.ndarray = field(default_factory=lambda: np.zeros(POSITION_BINS))
    top: list[tuple[float, int]] = field(default_factory=list)
    quant_token: np.ndarray = field(default_factory=lambda: np.zeros(len(QUANT_BITS)))
    quant_channel: np.ndarray = field(default_factory=lambda: np.zeros(len(QUANT_BITS)))
    backend: str = "cpu"  # "cpu": the compiled kernel (or numpy); "mlx": mlx on its default device
    _pending: Any = field(default=None, init=False, repr=False, compare=False)  # mlx: a piece in flight
    _row: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    _flag_array: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.groups = stat_groups(self.groups)
        self.power = np.zeros((4, self.dim))
        self.absmax = np.zeros(self.dim)
        self.gram = np.zeros((self.dim, self.dim))
        self.unit_sum = np.zeros(self.dim)
        self.band = np.zeros(self.rope.dims // 2) if self.rope is not None else None

    def add(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """Add ``rows`` ``(n_tokens, dim)`` at absolute ``positions`` ``(n_tokens,)``: the fused
        compiled kernel (`analysis.kernel`) where numba is installed, else numpy; with
        ``backend="mlx"``, mlx on its default device (`analysis.mlx_kernel`)."""
        self._row = None
        if self.backend == "mlx":
            from kvsnap.analysis import mlx_kernel

            mlx_kernel.add(self, rows, positions)
        elif kernel.AVAILABLE:
            self._add_compiled(rows, positions)
        else:
            self._add_numpy(rows, positions)

    def _flags(self) -> np.ndarray:
        if self._flag_array is not None:
            return self._flag_array
        flags = self._flag_array = np.zeros(5, np.int64)
        flags[kernel.NORMS] = "norms" in self.groups
        flags[kernel.CHANNELS] = "channels" in self.groups
        flags[kernel.ROPE] = "rope" in self.groups and self.band is not None
        flags[kernel.MEAN] = "channels" in self.groups or "spectrum" in self.groups
        flags[kernel.QUANT] = "quant" in self.groups
        return flags

    def _add_compiled(self, rows: np.ndarray, positions: np.ndarray) -> None:
        # Few Python-level calls per piece: with many threads, what holds the GIL sets the pace.
        if self.band is not None and self.rope is not None:
            first, second = self.rope.pair_indices()
            band = self.band
        else:
            first = second = _NO_PAIRS
            band = _NO_BAND
        flags = self._flags()
        channels, spectrum = "channels" in self.groups, "spectrum" in self.groups
        scalars = np.array([0.0, 0.0, self.norm_min, self.norm_max, 0.0, 0.0])
        absmax_bits = np.zeros(self.dim, np.int32)
        sums = np.zeros(self.dim)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        for start in range(0, rows.shape[0], _PIECE):
            x = _float32(rows[start : start + _PIECE])
            n = x.shape[0]
            if not n:
                continue
            pos = positions[start : start + n]
            peak_bits = np.empty(n, np.int32)
            square_norms = np.empty(n)
            sums[:] = 0.0
            kernel.accumulate(
                x,
                x.view(np.int32),
                pos,
                first,
                second,
                _LEVELS,
                flags,
                scalars,
                self.norm_hist,
                self.peak_hist,
                sums,
                self.power,
                absmax_bits,
                self.unit_sum,
                band,
                self.position_count,
                self.position_norm,
                peak_bits,
                square_norms,
                self.quant_token,
                self.quant_channel,
            )
            if spectrum:
                self._add_gram(x, sums, square_norms)
            self.count += n
            if channels:
                best = np.argpartition(peak_bits, n - TOP_K)[n - TOP_K :] if n > TOP_K else range(n)
                peaks = peak_bits.view(np.float32)
                self.top = sorted(self.top + [(float(peaks[i]), int(pos[i])) for i in best], reverse=True)[
                    :TOP_K
                ]
        if channels:
            self.absmax = np.maximum(self.absmax, absmax_bits.view(np.float32))
        self.norm_sum += float(scalars[0])
        self.norm_sq_sum += float(scalars[1])
        self.norm_min, self.norm_max = float(scalars[2]), float(scalars[3])
        self.first_norm_sum += float(scalars[4])
        self.first_count += int(scalars[5])

    def _add_gram(self, x: np.ndarray, sums: np.ndarray, square_norms: np.ndarray) -> None:
        """Add ``x`` ``(n, dim)`` float32 (channel sums ``sums`` float64, row norms squared
        ``square_norms``) to the Gram matrix.

        Pieces under `_GRAM_FLOAT64_ROWS` rows are added in float64. In larger ones, rows over
        `_HEAVY` times the piece's median squared norm (massive activations, attention
        sinks) are added in float64: in float32 they would set the rounding of every entry. The
        others run in float32 (BLAS) less their mean ``c``, so rounding is relative to their
        spread, in pieces of `_GRAM_ROWS` added in float64:
        ``sum x x^T = sum (x-c)(x-c)^T + c s^T + s c^T - n c c^T`` with ``s = sum x``."""
        if x.shape[0] < _GRAM_FLOAT64_ROWS:  # small pieces: float64 costs nothing there
            x64 = x.astype(np.float64)
            self.gram += x64.T @ x64
            return
        heavy = kernel.heavy_rows(square_norms, _HEAVY)
        if heavy.any():
            big = x[heavy].astype(np.float64)
            self.gram += big.T @ big
            x = x[~heavy]
            sums = sums - big.sum(axis=0)
        n = x.shape[0]
        if not n:
            return
        center = (sums / n).astype(np.float32)  # the shift; exact shifts are not needed
        # Few, large numpy calls (each releases the GIL): one shift, one batched product of
        # every _GRAM_ROWS-row piece, one float64 sum of the partial Gram matrices.
        shifted = x - center
        full = n - n % _GRAM_ROWS
        if full:
            stacked = shifted[:full].reshape(-1, _GRAM_ROWS, x.shape[1])
            self.gram += np.matmul(stacked.transpose(0, 2, 1), stacked).sum(axis=0, dtype=np.float64)
        if full < n:
            rest = shifted[full:]
            self.gram += rest.T @ rest
        kernel.add_shift_terms(self.gram, center, sums, n)

    def _add_numpy(self, rows: np.ndarray, positions: np.ndarray) -> None:
        for start in range(0, rows.shape[0], _PIECE):
            x = np.asarray(rows[start : start + _PIECE], dtype=np.float64)
            pos = positions[start : start + _PIECE]
            if not x.shape[0]:
                continue
            x2 = x * x
            sq = x2.sum(axis=1)
            norms = np.sqrt(sq)
            self.count += x.shape[0]
            self.norm_sum += float(norms.sum())
            self.norm_sq_sum += float(sq.sum())
            self.norm_min = min(self.norm_min, float(norms.min()))
            self.norm_max = max(self.norm_max, float(norms.max()))
            self.norm_hist += np.bincount(_hist_index(norms), minlength=_BINS)
            magnitude = np.abs(x)
            peaks = magnitude.max(axis=1)
            self.peak_hist += np.bincount(_hist_index(peaks), minlength=_BINS)
            self.absmax = np.maximum(self.absmax, magnitude.max(axis=0))
            del magnitude
            self.power[0] += x.sum(0)
            self.power[1] += x2.sum(0)
            self.power[2] += np.einsum("ij,ij->j", x2, x)
            self.power[3] += np.einsum("ij,ij->j", x2, x2)
            del x2
            self.gram += x.T @ x
            self.unit_sum += (1.0 / np.maximum(norms, 1e-30)) @ x
            if self.band is not None and self.rope is not None:
                self.band += self.rope.pair_energy(x)
            if pos.size and pos[0] == 0:
                self.first_norm_sum += float(norms[0])
                self.first_count += 1
            bins = np.where(pos > 0, np.floor(np.log2(np.maximum(pos, 1))).astype(np.int64) + 1, 0)
            bins = np.clip(bins, 0, POSITION_BINS - 1)
            self.position_count += np.bincount(bins, minlength=POSITION_BINS)
            self.position_norm += np.bincount(bins, weights=norms, minlength=POSITION_BINS)
            best = np.argsort(peaks)[-TOP_K:]
            self.top = sorted(self.top + [(float(peaks[i]), int(pos[i])) for i in best], reverse=True)[:TOP_K]
            x32 = np.asarray(rows[start : start + _PIECE], dtype=np.float32)
            for i, bits in enumerate(QUANT_BITS):
                self.quant_token[i] += _quant_error(x32, bits, axis=1)
                self.quant_channel[i] += _quant_error(x32, bits, axis=0)

    def settle(self) -> None:
        """Fold in device work still in flight (``backend="mlx"``; a no-op otherwise)."""
        if self._pending is not None:
            from kvsnap.analysis import mlx_kernel

            mlx_kernel.settle(self)

    def __getstate__(self) -> dict[str, Any]:
        self.settle()  # device arrays do not cross processes; their sums do
        return dict(self.__dict__)

    def merge(self, other: HeadAccumulator) -> None:
        """Add another accumulator of the same (layer, head, tensor) into this one (another chunk,
        sequence or file); raises ValueError when the channel counts or the groups differ."""
        self.settle()
        other.settle()
        if other.dim != self.dim:
            raise ValueError(f"cannot merge {other.dim}-channel statistics into {self.dim}-channel ones")
        if other.groups != self.groups:
            raise ValueError(
                f"cannot merge statistics of groups {sorted(other.groups)} into {sorted(self.groups)}"
            )
        self._row = None
        self.count += other.count
        self.norm_sum += other.norm_sum
        self.norm_sq_sum += other.norm_sq_sum
        self.norm_min = min(self.norm_min, other.norm_min)
        self.norm_max = max(self.norm_max, other.norm_max)
        for name in (
            "norm_hist",
            "peak_hist",
            "power",
            "gram",
            "unit_sum",
            "position_count",
            "position_norm",
            "quant_token",
            "quant_channel",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.absmax = np.maximum(self.absmax, other.absmax)
        if self.band is not None and other.band is not None:
            self.band = self.band + other.band
        self.first_norm_sum += other.first_norm_sum
        self.first_count += other.first_count
        self.top = sorted(self.top + other.top, reverse=True)[:TOP_K]

    def row(self) -> dict[str, Any]:
        """The statistics of the accumulator's groups, ``n_tokens`` first (see analysis/README.md
        for each formula); columns of groups not computed are absent. Computed once until the
        next `add` or `merge` (a pass computes it on its worker threads)."""
        if self._row is None:
            self._row = self._statistics()
        return dict(self._row)

    def _statistics(self) -> dict[str, Any]:
        self.settle()
        n = self.count
        row: dict[str, Any] = {"n_tokens": n}
        if not n:
            return row
        m1 = self.power[0] / n
        if "norms" in self.groups:
            row.update(self._norms(n))
        if "channels" in self.groups:
            row.update(self._channels(n, m1))
        if "rope" in self.groups:
            row["rope_band_energy"] = (
                (self.band / max(float(self.band.sum()), 1e-30)).tolist() if self.band is not None else None
            )
        if "spectrum" in self.groups:
            row.update(self._spectrum(n, m1))
        if "quant" in self.groups:
            energy = self.norm_sq_sum
            for i, bits in enumerate(QUANT_BITS):
                for axis, sums in (("token", self.quant_token), ("channel", self.quant_channel)):
                    row[f"quant{bits}_{axis}_error"] = float(sums[i] / energy) if energy else float("nan")
        return row

    def _norms(self, n: int) -> dict[str, Any]:
        mean_norm = self.norm_sum / n
        sq_mean = self.norm_sq_sum / n
        with np.errstate(divide="ignore", invalid="ignore"):
            by_position = np.where(self.position_count > 0, self.position_norm / self.position_count, np.nan)
        last_bin = int(np.flatnonzero(self.position_count).max()) + 1 if self.position_count.any() else 0
        return {
            "norm_mean": mean_norm,
            "norm_std": float(np.sqrt(max(sq_mean - mean_norm**2, 0.0))),
            "norm_min": self.norm_min,
            "norm_max": self.norm_max,
            "norm_p50": _hist_quantile(self.norm_hist, 0.5),
            "norm_p99": _hist_quantile(self.norm_hist, 0.99),
            "norm_sq_mean": sq_mean,
            "sink_ratio": self.first_norm_sum / self.first_count / mean_norm
            if self.first_count
            else float("nan"),
            "norm_by_position": by_position[:last_bin].tolist(),
            "anisotropy": float(np.linalg.norm(self.unit_sum / n)),
        }

    def _channels(self, n: int, m1: np.ndarray) -> dict[str, Any]:
        _, m2, m3, m4 = self.power / n
        var = np.maximum(m2 - m1 * m1, 0.0)
        central4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1**4
        with np.errstate(divide="ignore", invalid="ignore"):
            kurtosis = np.where(var > 0, central4 / (var * var) - 3.0, np.nan)
        peak_median = _hist_quantile(self.peak_hist, 0.5)
        return {
            "channel_mean": m1.tolist(),
            "channel_var": var.tolist(),
            "channel_absmax": self.absmax.tolist(),
            "outlier_channel_ratio": float(self.absmax.max() / max(np.median(self.absmax), 1e-30)),
            "channel_kurtosis": kurtosis.tolist(),
            "massive_positions": [p for _, p in self.top],
            "massive_values": [v for v, _ in self.top],
            "massive_ratio": self.top[0][0] / peak_median if self.top and peak_median > 0 else float("nan"),
        }

    def _spectrum(self, n: int, m1: np.ndarray) -> dict[str, Any]:
        covariance = self.gram / n - np.outer(m1, m1)
        # compiled where the kernel is (parallel over heads), LAPACK on the numpy reference path
        descending = eigenvalues(covariance) if kernel.AVAILABLE else np.linalg.eigvalsh(covariance)[::-1]
        eig = np.clip(descending, 0.0, None)
        total = float(eig.sum())
        cumulative = np.cumsum(eig) / total if total > 0 else np.ones_like(eig)
        probabilities = eig / total if total > 0 else eig
        nonzero = probabilities[probabilities > 0]
        row: dict[str, Any] = {
            "eigenvalues": eig.tolist(),
            "rank_90": int(np.searchsorted(cumulative, 0.9) + 1),
            "effective_rank": float(np.exp(-(nonzero * np.log(nonzero)).sum())) if nonzero.size else 0.0,
        }
        for r in RANKS:
            kept = float(eig[:r].sum()) / total if total > 0 else 1.0
            row[f"rank{r}_error"] = 1.0 - kept
        return row


Key = tuple[int, int, int, str]  # (seq, layer, head, "k" | "v")


@dataclass(frozen=True)
class PassOptions:
    """What one streaming pass over a file computes, and with how many threads.

    ``snapshot``: index (negative from the end); ``keys``: ``"post_rope"`` or ``"pre_rope"``;
    ``stats``: the statistic groups (`GROUPS`); ``threads``: threads on this file's blocks;
    ``storage_options``: fsspec options for URLs; ``progress``: a bar of layers on stderr;
    ``backend``: ``"cpu"`` (the compiled kernel on ``threads`` threads) or ``"mlx"`` (mlx on its
    default device, driven by one thread that reads the next block while the device works)."""

    snapshot: int = -1
    keys: str = "post_rope"
    stats: frozenset[str] = ALL
    threads: int = 1
    storage_options: dict[str, Any] | None = field(default=None, compare=False)
    progress: bool = field(default=False, compare=False)  # a bar per layer on a terminal's stderr
    backend: str = "cpu"

    def __post_init__(self) -> None:
        if self.keys not in ("post_rope", "pre_rope"):
            raise ValueError("keys must be 'post_rope' or 'pre_rope'")
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be a positive integer, not {self.threads!r}")
        check_backend(self.backend)
        object.__setattr__(self, "stats", stat_groups(self.stats))
        if self.backend == "mlx":  # one thread drives the device; mlx is not used from several
            object.__setattr__(self, "threads", 1)


BACKENDS = ("cpu", "mlx")


def check_backend(backend: str) -> None:
    """ValueError for an unknown backend, or ``"mlx"`` where mlx is not installed."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if backend == "mlx":
        from kvsnap.analysis import mlx_kernel

        if not mlx_kernel.available():
            raise ValueError("backend 'mlx' needs mlx: pip install 'kvsnap[capture]' (or mlx-cuda, mlx[cpu])")


def _add_segments(
    snap: kvformat.Snapshot,
    segments: list[kvformat.Segment],
    k_acc: HeadAccumulator,
    v_acc: HeadAccumulator,
    rope: Rope | None,
    pipeline: Any = None,
) -> None:
    """Read (CRC, decode), add and release each segment of one head, in order; K is un-rotated
    by ``rope`` when given. Runs on a pass's worker thread: reading there spreads the page faults
    and checksums of a memory-mapped file over the cores. With an mlx ``pipeline``
    (`mlx_kernel.Pipeline`) the rows join its next device batch instead."""
    for segment in segments:
        block = snap.read(segment)
        k = block.k if rope is None else rope.rotate(block.k, block.positions, inverse=True)
        if pipeline is not None:
            pipeline.add(k_acc, k, block.positions)
            pipeline.add(v_acc, block.v, block.positions, after=functools.partial(snap.release, segment))
            continue
        k_acc.add(k, block.positions)
        v_acc.add(block.v, block.positions)
        snap.release(segment)


def _layers(
    path: str | os.PathLike[str], options: PassOptions, progress: bool = False, finish: bool = False
) -> Iterator[tuple[str, int, int, dict[Key, HeadAccumulator]]]:
    """One streaming pass over a file, yielding ``(file name, snapshot index, layer, its
    accumulators)`` as soon as the pass is past the layer's last chunk and its work is done, so
    memory holds the accumulators of the layers in progress only (one or two for a layer-major
    file).

    With ``options.threads`` = T > 1, consecutive blocks of a head (up to 8 MiB of K and V, or
    one block if larger) go to T threads as one K task and one V task, at most T + 2 such
    batches in flight (`analysis.parallel.OrderedPool`): memory is about
    ``(T + 3) x max(8 MiB, block) + T x 3 x 8192 x head_dim x 4 bytes (float32 pieces) + the
    accumulators of the layers in progress`` (each ``~(head_dim^2 + 6 head_dim) x 8 + 36 KiB``).
    ``progress`` shows a bar per layer on stderr when it is a terminal; ``finish`` computes each
    accumulator's row (eigenvalues and all) on the threads, once its layer is read."""
    from concurrent.futures import ThreadPoolExecutor

    from kvsnap.analysis.parallel import OrderedPool, cores, single_threaded_blas

    with kvformat.open(path, options.snapshot, storage_options=options.storage_options) as snap:
        name, index = os.fspath(path), snap.index
        ropes: dict[int, Rope | None] = {}
        for layer, spec in enumerate(snap.layers):
            if not spec.present:
                continue
            try:
                ropes[layer] = Rope.from_metadata(snap.metadata, spec.attributes, spec.k_dim)
            except ValueError:
                if options.keys == "pre_rope":
                    raise
                ropes[layer] = None
        unrotate = options.keys == "pre_rope"

        def fresh(layer: int) -> dict[Key, HeadAccumulator]:
            spec = snap.layers[layer]
            table: dict[Key, HeadAccumulator] = {}
            for seq in range(snap.num_seqs):
                for head in range(spec.num_heads):
                    table[(seq, layer, head, "k")] = HeadAccumulator(
                        spec.k_dim, ropes[layer], options.stats, backend=options.backend
                    )
                    table[(seq, layer, head, "v")] = HeadAccumulator(
                        spec.v_dim, None, options.stats, backend=options.backend
                    )
            return table

        last = {seg.layer: i for i, seg in enumerate(snap.segments())}  # the pass goes in this order
        k_row_bytes = {layer: spec.row_bytes(0) for layer, spec in enumerate(snap.layers) if spec.present}
        v_row_bytes = {layer: spec.row_bytes(1) for layer, spec in enumerate(snap.layers) if spec.present}
        bar = _layer_bar(name, len(ropes), progress)
        for layer in ropes:
            if layer not in last:  # present but holding no tokens
                bar.update()
                yield name, index, layer, fresh(layer)
        # Consecutive segments of one head go to one task (up to _BATCH_BYTES of K and V): the
        # tasks in flight span many heads even when a head is stored in many chunks. The task
        # reads its segments itself, so checksums and page faults run on every core.
        window = options.threads + 2
        in_progress: dict[int, tuple[dict[Key, HeadAccumulator], list[Any]]] = {}
        closing: collections.deque[int] = collections.deque()
        batch: list[kvformat.Segment] = []
        in_flight: collections.deque[Any] = collections.deque()

        def finished(wait: bool) -> Iterator[tuple[str, int, int, dict[Key, HeadAccumulator]]]:
            """The closed layers whose work is done, in order (all of them when ``wait``)."""
            while closing and (wait or all(f.done() for f in in_progress[closing[0]][1])):
                done = closing.popleft()
                for future in in_progress[done][1]:
                    future.result()
                bar.update()
                yield name, index, done, in_progress.pop(done)[0]

        def submit() -> None:
            first = batch[0]
            table, futures = in_progress[first.layer]
            k_acc = table[(first.seq, first.layer, first.head, "k")]
            v_acc = table[(first.seq, first.layer, first.head, "v")]
            rope = ropes[first.layer] if unrotate else None
            snap.prefetch(batch)
            key = (first.seq, first.layer, first.head)
            future = pool.submit(key, _add_segments, snap, list(batch), k_acc, v_acc, rope, pipeline)
            futures.append(future)
            in_flight.append(future)
            batch.clear()

        # BLAS on one thread whatever the thread count: the Gram's rounding then does not depend
        # on it (BLAS splits sums differently over its own threads).
        rows_threads = cores() if options.backend == "mlx" else 1
        pipeline = None
        if options.backend == "mlx":
            from kvsnap.analysis.mlx_kernel import Pipeline

            pipeline = Pipeline()
        with (
            pipeline if pipeline is not None else contextlib.nullcontext(),
            single_threaded_blas(),
            OrderedPool(options.threads) as pool,
            ThreadPoolExecutor(rows_threads, thread_name_prefix="kvsnap-rows") as row_pool,
            bar,
        ):
            size = 0
            for i, segment in enumerate(snap.segments()):
                layer = segment.layer
                if layer not in in_progress:
                    in_progress[layer] = (fresh(layer), [])
                if batch and (
                    (segment.seq, layer, segment.head) != (batch[0].seq, batch[0].layer, batch[0].head)
                    or size >= _BATCH_BYTES
                ):
                    submit()
                if not batch:
                    size = 0
                batch.append(segment)
                size += segment.count * (k_row_bytes[layer] + v_row_bytes[layer])
                if last[layer] == i:
                    submit()
                    table, futures = in_progress[layer]
                    if pipeline is not None:
                        # What is still on the device is folded in on this thread (the one that
                        # drives mlx); rows (eigenvalues) then run on CPU threads.
                        pipeline.finish()
                        if finish:
                            futures.extend(row_pool.submit(acc.row) for acc in table.values())
                    elif finish:
                        futures.extend(pool.submit(key[:3], acc.row) for key, acc in table.items())
                    closing.append(layer)
                while len(in_flight) > window:
                    in_flight.popleft().result()
                yield from finished(wait=False)
            pool.drain()
            yield from finished(wait=True)


def _layer_bar(name: str, layers: int, show: bool) -> Any:
    """A tqdm bar over the layers of one file: on stderr, only when it is a terminal."""
    from tqdm import tqdm

    return tqdm(
        total=layers,
        desc=os.path.basename(name) or name,
        unit="layer",
        file=sys.stderr,
        disable=None if show else True,  # None: off when stderr is not a terminal
        leave=False,
    )


def _accumulate(path: str | os.PathLike[str], options: PassOptions) -> dict[Key, HeadAccumulator]:
    """One streaming pass over a file: the accumulator of every key."""
    table: dict[Key, HeadAccumulator] = {}
    for _, _, _, accumulators in _layers(path, options):
        table.update(accumulators)
    return table


def _rows(name: str, index: int, accumulators: dict[Key, HeadAccumulator]) -> list[dict[str, Any]]:
    return [
        {
            "file": name,
            "snapshot": index,
            "seq": seq,
            "layer": layer,
            "head": head,
            "tensor": tensor,
            **acc.row(),
        }
        for (seq, layer, head, tensor), acc in sorted(accumulators.items())
    ]


def stats_rows(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    keys: str = "post_rope",
    *,
    stats: str | Iterable[str] | None = None,
    jobs: int = 1,
    backend: str = "cpu",
) -> list[dict[str, Any]]:
    """Rows of per-head statistics for one file (one streaming pass, ``jobs`` threads, or mlx
    with ``backend="mlx"``), as dicts: within a layer by (seq, head, tensor)."""
    options = PassOptions(snapshot, keys, stat_groups(stats), jobs, backend=backend)
    return [
        row
        for name, index, _, table in _layers(path, options, finish=True)
        for row in _rows(name, index, table)
    ]


def stats_for_file(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    keys: str = "post_rope",
    storage_options: dict[str, Any] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    jobs: int = 1,
    progress: bool = False,
    backend: str = "cpu",
) -> Iterator[pa.Table]:
    """The per-head statistics of one file (a path or a URL) as Arrow tables, one per layer, each
    yielded as soon as the streaming pass is past that layer's last chunk; ``stats`` picks the
    groups (`GROUPS`, all by default), ``jobs`` threads share the file. No global state: a
    process pool or a distributed engine can call it per file."""
    options = PassOptions(snapshot, keys, stat_groups(stats), jobs, storage_options, backend=backend)
    yield from _tables(path, options, progress)


def _tables(path: str | os.PathLike[str], options: PassOptions, progress: bool = False) -> Iterator[pa.Table]:

    for name, index, _, accumulators in _layers(path, options, progress, finish=True):
        yield _arrow_table(_rows(name, index, accumulators))


def _arrow_table(rows: list[dict[str, Any]]) -> pa.Table:
    """``pa.Table.from_pylist(rows)``, built column by column (6x faster: lists of floats go in as
    one flat array and offsets). Columns: every key of every row, in first-seen order."""
    import pyarrow as pa

    names = list(dict.fromkeys(key for row in rows for key in row))
    columns = {}
    for name in names:
        values = [row.get(name) for row in rows]
        first = values[0]
        if (
            isinstance(first, list)
            and first
            and isinstance(first[0], float)
            and all(isinstance(v, list) for v in values)
        ):
            lists: list[list[float]] = values  # type: ignore[assignment]  # checked just above
            offsets = np.zeros(len(lists) + 1, np.int32)
            np.cumsum([len(v) for v in lists], out=offsets[1:])
            flat = np.fromiter((x for v in lists for x in v), np.float64, int(offsets[-1]))
            columns[name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        else:
            columns[name] = pa.array(values)
    return pa.table(columns)


def file_accumulators(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    keys: str = "post_rope",
    storage_options: dict[str, Any] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    jobs: int = 1,
    backend: str = "cpu",
) -> dict[tuple[int, int, str], HeadAccumulator]:
    """The mergeable state of one file, per (layer, head, tensor), its sequences merged: the unit
    that `analysis.batch.merged_stats` combines across files."""
    options = PassOptions(snapshot, keys, stat_groups(stats), jobs, storage_options, backend=backend)
    return merged_accumulators(path, options)


def merged_accumulators(
    path: str | os.PathLike[str], options: PassOptions
) -> dict[tuple[int, int, str], HeadAccumulator]:
    """`file_accumulators` with its options as one `PassOptions` (what the engines call)."""
    merged: dict[tuple[int, int, str], HeadAccumulator] = {}
    for (_, layer, head, tensor), acc in sorted(_accumulate(path, options).items()):
        key = (layer, head, tensor)
        if key in merged:
            merged[key].merge(acc)
        else:
            merged[key] = acc
    return merged


def file_table(path: str | os.PathLike[str], options: PassOptions) -> pa.Table:
    """Every layer's table of one file, concatenated (what the engines call per file)."""
    import pyarrow as pa

    tables = list(_tables(path, options, options.progress))
    return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})


def _paths(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str | os.PathLike[str]]:
    return [paths] if isinstance(paths, str | os.PathLike) else list(paths)


_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def local_map(function: Callable[..., Any], paths: Sequence[Any], jobs: int, *args: Any) -> Iterator[Any]:
    """``function(path, *args)`` for each path, in order, in ``jobs`` spawned processes."""
    if jobs <= 1 or len(paths) <= 1:
        for path in paths:
            yield function(path, *args)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
    # One BLAS thread per worker (as Ray does): N processes x a spinning BLAS pool each would
    # oversubscribe the cores. Workers inherit the environment when they are spawned (on submit).
    saved = {name: os.environ.get(name) for name in _THREAD_VARIABLES}
    os.environ.update(dict.fromkeys(_THREAD_VARIABLES, "1"))
    try:
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context)
        futures = [pool.submit(function, path, *args) for path in paths]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    with pool:
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def file_tables(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    backend: str = "cpu",
) -> Iterator[pa.Table]:
    """One Arrow table per file, in the order given, on ``jobs`` cores (default: all of this
    process's): files in parallel processes first, the rest as threads within each file; with
    ``backend="mlx"`` one file after another, on mlx's device. ``progress`` is called with each
    file name as it finishes."""
    from kvsnap.analysis.parallel import cores, split_jobs

    files = _paths(paths)
    processes, threads = split_jobs(cores() if jobs is None else jobs, len(files))
    if backend == "mlx":
        processes = threads = 1
    options = PassOptions(
        snapshot, keys, stat_groups(stats), threads, progress=len(files) == 1, backend=backend
    )
    for path, table in zip(files, local_map(file_table, files, processes, options), strict=True):
        if progress:
            progress(os.fspath(path))
        yield table


def head_stats(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    stats: str | Iterable[str] | None = None,
    backend: str = "cpu",
) -> pl.DataFrame:
    """A Polars DataFrame, one row per (file, seq, layer, head, tensor); ``keys="pre_rope"``
    un-rotates K first using the RoPE description in the metadata; ``stats`` names the groups
    (`GROUPS`; default all); ``jobs`` cores (default: all); ``backend="mlx"`` computes on mlx's
    default device (a GPU where there is one); ``progress`` is called with each file name as it
    finishes."""
    return frame_of(list(file_tables(paths, snapshot, keys, jobs, progress, stats=stats, backend=backend)))


def frame_of(tables: list[pa.Table]) -> pl.DataFrame:
    """One Polars DataFrame of Arrow tables (columns unified, empty tables dropped)."""
    import polars as pl
    import pyarrow as pa

    tables = [t for t in tables if t.num_rows]
    if not tables:
        return pl.DataFrame()
    frame = pl.from_arrow(pa.concat_tables(tables, promote_options="default"))
    assert isinstance(frame, pl.DataFrame)
    return frame


def head_stats_reader(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    *,
    stats: str | Iterable[str] | None = None,
) -> pa.RecordBatchReader:
    """The same rows as an Arrow RecordBatchReader, one batch per file (streams file by file)."""
    import pyarrow as pa

    tables = file_tables(paths, snapshot, keys, jobs, stats=stats)
    first = next(tables, None)
    if first is None:
        return pa.RecordBatchReader.from_batches(pa.schema([]), iter(()))
    schema = first.schema

    def batches() -> Iterator[pa.RecordBatch]:
        yield from first.cast(schema).to_batches()
        for table in tables:
            yield from table.cast(schema).to_batches()

    return pa.RecordBatchReader.from_batches(schema, batches())


def token_table(
    path: str | os.PathLike[str], snapshot: int = -1, storage_options: dict[str, Any] | None = None
) -> pl.LazyFrame:
    """Per-token scalars as a LazyFrame, built chunk by chunk: seq, layer, head, position,
    k_norm, v_norm, k_absmax, and where the file records them (SPEC 15.3) ``token_id`` and
    ``token_text`` (the token decoded alone), null where it does not."""
    import polars as pl

    frames = []
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        ids, pieces = token_ids(snap), token_pieces(snap)

        def label(values: list[list[Any]] | None, seq: int, positions: np.ndarray) -> list[Any]:
            known = values[seq] if values is not None and seq < len(values) else []
            return [known[p] if p < len(known) else None for p in positions.tolist()]

        for block in snap.blocks():
            k = np.asarray(block.k, dtype=np.float32)
            v = np.asarray(block.v, dtype=np.float32)
            frames.append(
                pl.DataFrame(
                    {
                        "seq": np.full(block.positions.size, block.seq, np.int32),
                        "layer": np.full(block.positions.size, block.layer, np.int32),
                        "head": np.full(block.positions.size, block.head, np.int32),
                        "position": block.positions,
                        "k_norm": np.linalg.norm(k, axis=1),
                        "v_norm": np.linalg.norm(v, axis=1),
                        "k_absmax": np.abs(k).max(axis=1) if k.size else np.empty(0, np.float32),
                        "token_id": pl.Series(label(ids, block.seq, block.positions), dtype=pl.Int64),
                        "token_text": pl.Series(label(pieces, block.seq, block.positions), dtype=pl.Utf8),
                    }
                )
            )
    if not frames:
        return pl.LazyFrame()
    return pl.concat(frames).lazy()


def outliers(
    table: pl.DataFrame, factor: float = 1.5, stat: str = "norm_mean", tensor: str = "k"
) -> pl.DataFrame:
    """The ``tensor`` rows with ``ratio_to_median`` (``stat`` / the median head of its file) and
    an ``outlier`` flag where it exceeds ``factor``."""
    import polars as pl

    rows = table.filter(pl.col("tensor") == tensor)
    ratio = (pl.col(stat) / pl.col(stat).median().over("file")).alias("ratio_to_median")
    return rows.with_columns(ratio).with_columns((pl.col("ratio_to_median") > factor).alias("outlier"))
