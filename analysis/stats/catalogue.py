"""The statistics catalogue: which statistics exist (`GROUPS`), their fixed parameters, and
the numpy definitions the kernels are held to (`quant_error`, the log histogram). Shared by the
accumulator (`analysis.engine.accumulator`), the compiled kernel and the mlx kernel. The formulas are
in ``analysis/README.md``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

# The groups and their columns, by name (re-exported: the catalogue's names)
from .groups import ALL, ALWAYS, GROUPS, LIST_COLUMNS, QUANT_BITS, RANKS, stat_groups  # noqa: F401

LOG_LOW, LOG_HIGH, BINS = -8.0, 8.0, 2048  # log10 histogram of norms and peaks: ~1.8% relative bin width
TOP_K = 8  # largest per-token peaks kept (massive activations)
LEVELS = np.array([(1 << bits) - 1 for bits in QUANT_BITS], np.int64)  # their steps
QUANT_GROUP = 32  # channels per token group, and tokens per channel group
POSITION_BINS = 48  # norm by position: [0,1), [1,2), [2,4), ... [2^46, 2^47)


def position_bins(positions: np.ndarray) -> np.ndarray:
    """The norm-by-position bin of each position (int64): 0 for position 0, ``floor(log2 p) + 1``
    after, the last bin holding everything beyond."""
    bins = np.zeros(positions.shape, np.int64)
    positive = positions > 0
    bins[positive] = np.floor(np.log2(positions[positive].astype(np.float64))).astype(np.int64) + 1
    np.minimum(bins, POSITION_BINS - 1, out=bins)
    return bins


def hist_index(values: np.ndarray) -> np.ndarray:
    logs = np.log10(np.maximum(values, 10.0**LOG_LOW))
    scaled = (logs - LOG_LOW) / (LOG_HIGH - LOG_LOW) * BINS
    return np.clip(scaled.astype(np.int64), 0, BINS - 1)


@functools.cache
def hist_edges(float_type: type = np.float64, squared: bool = False) -> np.ndarray:
    """``(BINS + 1,)`` of ``float_type`` (float32 or float64): ``edges[k]`` is the smallest
    ``v >= 0`` of that type that `hist_index` (in float64; of ``sqrt(v)`` if ``squared``: a
    squared norm) puts in bin ``k`` or above; ``-inf`` and ``inf`` at the ends. Found by bisection
    over the bit patterns of the type's non-negative values (ordered like the values), so a
    value's bin is the number of inner edges at or below it: exactly `hist_index`'s. Used where
    a logarithm per value costs too much (the CPU kernel, the mlx device function)."""
    kind = np.dtype(float_type)
    unsigned = np.dtype(f"uint{8 * kind.itemsize}")
    largest = int(np.finfo(kind).max.view(unsigned))

    def host_bin(bits: np.ndarray) -> np.ndarray:
        values = bits.astype(unsigned).view(kind).astype(np.float64)
        return hist_index(np.sqrt(values) if squared else values)

    wanted = np.arange(1, BINS, dtype=np.int64)
    low = np.zeros(wanted.size, np.int64)
    high = np.full(wanted.size, largest, np.int64)
    while bool(np.any(low < high)):
        middle = low + (high - low) // 2
        reached = host_bin(middle) >= wanted
        high = np.where(reached, middle, high)
        low = np.where(reached, low, middle + 1)
    edges = np.empty(BINS + 1, kind)
    edges[0], edges[-1] = -np.inf, np.inf
    edges[1:-1] = low.astype(unsigned).view(kind)
    return edges


def hist_quantiles(hists: np.ndarray, qs: tuple[float, ...]) -> np.ndarray:
    """``(B, len(qs))``: the ``qs`` quantiles of each log histogram of ``hists`` ``(B, BINS)``,
    each its bin's center (NaN for an empty histogram); one cumulative sum per histogram."""
    cumulative = np.cumsum(hists, axis=-1)
    total = cumulative[:, -1:]
    # searchsorted(side="left") of q x total: how many cumulative counts lie below it
    index = (cumulative[:, None, :] < np.asarray(qs)[None, :, None] * total[:, :, None]).sum(axis=-1)
    centers = 10.0 ** (LOG_LOW + (index + 0.5) * ((LOG_HIGH - LOG_LOW) / BINS))
    return np.where(total > 0, centers, np.nan)


def _group_error(groups: np.ndarray, levels: int, axis: int) -> float:
    """Squared error of min-max quantizing ``groups`` to ``levels`` steps along ``axis``: the
    level of ``x`` is ``round((x - low) * (1 / step))`` in float32, the step's reciprocal
    rounded first (as the compiled kernel computes it: the same float32 operations give the same
    levels, ties included, where a division could round a value to the other side of a half)."""
    low = groups.min(axis=axis, keepdims=True)
    high = groups.max(axis=axis, keepdims=True)
    step = np.where(high > low, (high - low) / levels, np.float32(1.0))
    restored = np.round((groups - low) * (np.float32(1.0) / step)) * step + low
    restored -= groups
    np.square(restored, out=restored)
    return float(restored.sum(dtype=np.float64))


def quant_error(x: np.ndarray, bits: int, axis: int) -> float:
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


@dataclass(frozen=True)
class Sum:
    """One sum a head's accumulator keeps: its ``shape`` (``()``: a number; else named axes:
    ``dim`` channels, ``bins`` of the log histogram, ``positions`` bins, ``quant`` bit widths,
    ``band`` RoPE frequency pairs), its ``dtype``, how two accumulators' values combine
    (``merge``: ``add``, ``min``, ``max``, or ``top``: the `TOP_K` largest ``(value, position)``
    pairs), and the groups whose columns read it (empty: every row). A backend's kernel adds rows
    into these; `HeadAccumulator` allocates and merges them from this list."""

    name: str
    merge: str
    groups: frozenset[str]
    shape: tuple[str, ...] = ()
    dtype: str = "float64"


def _sum(name: str, merge: str, groups: str, shape: tuple[str, ...] = (), dtype: str = "float64") -> Sum:
    return Sum(name, merge, frozenset(groups.split()), shape, dtype)


SUMS: tuple[Sum, ...] = (
    _sum("count", "add", "", dtype="int64"),
    _sum("nonfinite_rows", "add", "", dtype="int64"),
    _sum("nonfinite_values", "add", "", dtype="int64"),
    _sum("norm_sum", "add", "norms"),
    _sum("norm_sq_sum", "add", "norms quant"),  # quant: the energy its errors are fractions of
    _sum("norm_min", "min", "norms"),
    _sum("norm_max", "max", "norms"),
    _sum("norm_hist", "add", "norms", ("bins",), "int64"),
    _sum("peak_hist", "add", "channels", ("bins",), "int64"),
    _sum("power", "add", "channels spectrum", ("4", "dim")),  # sums of x, x^2, x^3, x^4
    _sum("absmax", "max", "channels", ("dim",)),
    _sum("gram", "add", "spectrum", ("dim", "dim")),  # (0, 0) without the spectrum group
    _sum("unit_sum", "add", "norms", ("dim",)),
    _sum("band", "add", "rope", ("band",)),  # None without a RoPE
    _sum("first_norm_sum", "add", "norms"),
    _sum("first_count", "add", "norms", dtype="int64"),
    _sum("position_count", "add", "norms", ("positions",), "int64"),
    _sum("position_norm", "add", "norms", ("positions",)),
    _sum("top", "top", "channels"),
    _sum("quant_token", "add", "quant", ("quant",)),
    _sum("quant_channel", "add", "quant", ("quant",)),
)
"""Every accumulated sum, declared once (see `Sum`)."""


def shape_of(total: Sum, dim: int, band: int | None) -> tuple[int, ...]:
    """The shape of ``total``'s array for ``dim`` channels and ``band`` RoPE pairs (None: 0)."""
    sizes = {
        "dim": dim,
        "bins": BINS,
        "positions": POSITION_BINS,
        "quant": len(QUANT_BITS),
        "band": band,
        "4": 4,
    }
    return tuple(int(sizes[axis] or 0) for axis in total.shape)


def size_of(total: Sum, dim: int, band: int | None) -> int:
    """The values in ``total``'s array (`shape_of`)."""
    return int(np.prod(shape_of(total, dim, band), dtype=np.int64))


def allocate(total: Sum, dim: int, band: int | None, groups: frozenset[str]) -> Any:
    """A fresh (zero) value of ``total`` for ``dim`` channels, ``band`` RoPE pairs (None: no RoPE)
    and the statistic ``groups``: an array of its shape, or None (``band`` without a RoPE)."""
    if total.name == "band" and band is None:
        return None
    shape = shape_of(total, dim, band)
    if total.name == "gram" and "spectrum" not in groups:
        shape = (0, 0)  # 128 KiB at 128 channels: allocated only where the spectrum needs it
    return np.zeros(shape, total.dtype)


def merged(total: Sum, mine: Any, theirs: Any) -> Any:
    """Two accumulators' values of ``total`` combined by its merge rule (new objects; a ``band``
    absent on either side stays as ``mine``)."""
    if mine is None or theirs is None:
        return mine
    if total.merge == "add":
        return mine + theirs
    if total.merge == "top":
        return sorted(mine + theirs, reverse=True)[:TOP_K]
    if isinstance(mine, np.ndarray):
        return np.minimum(mine, theirs) if total.merge == "min" else np.maximum(mine, theirs)
    return min(mine, theirs) if total.merge == "min" else max(mine, theirs)
