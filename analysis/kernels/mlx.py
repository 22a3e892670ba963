"""The mlx backend's device function: the statistics of a piece of rows as mlx array operations,
on mlx's default device (the Metal GPU of a Mac, an NVIDIA GPU with mlx's CUDA build, or the CPU).

Per piece (`arrays.PIECE` rows, so quantization groups of tokens start at the same rows as on the
CPU), one mlx function (`piece_function`; fused by ``mx.compile`` on Metal, `compiles`) computes
everything that touches every element: row norms (sums, extremes, sums per position bin,
histogram bins), peaks, channel power sums up to the 4th order, channel absmax, the unit-vector
sum, the Gram matrix of the rows less their mean (massive rows left out; on CUDA by kvsnap's own
kernel, `cuda_gram`), the 8/4/2-bit quantization errors, and the rows of its top peaks. The host
gets back a few vectors per piece and folds them into the accumulator's float64 sums (`mlx_fold`).

The backend's other jobs live beside it: `mlx_pipeline` (many accumulators per device call),
`mlx_staging` (host-to-device copy buffers), `mlx_sizing` (processes, threads, batch bytes).

`add` here serves one accumulator alone: it starts a piece (``mx.async_eval``) and folds it in at
the next `add` or `settle`. Sums run in float32 on the device within a piece, in float64 on the
host across pieces; `tests/analysis/kernels/test_mlx_backend.py` holds every column to the CPU kernel within
`TOLERANCES`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvformat.checksum import crc32c
from kvformat.errors import InvalidArgumentError

from ..dependencies import mx
from .arrays import GRAM_FLOAT64_ROWS, HEAVY, PIECE, bytes_of

if TYPE_CHECKING:
    from kvformat import PayloadCheck

    from ..stats.sums import RunningSums

from ..stats.catalogue import (
    BINS,
    LOG_HIGH,
    LOG_LOW,
    POSITION_BINS,
    QUANT_BITS,
    QUANT_GROUP,
    TOP_K,
    hist_edges,
)
from . import mlx_fold, mlx_staging
from .mlx_fold import join_results, piece_bins

SPAN = 64  # rows summed together on the device before the next level


TOLERANCES = {"default": 1e-4, "quantile": 0.02}
"""Agreement with the CPU kernel, held by the tests: every column within ``default`` relative,
except ``channel_mean`` (``default`` times the channel's standard deviation: means near zero),
``channel_kurtosis`` (``default`` times the non-excess kurtosis, ``k + 3``: excess kurtosis near
zero), ``eigenvalues`` (``default`` times the largest: the small ones are at float32 noise in
either kernel) and the histogram quantiles ``norm_p50``/``norm_p99`` (``quantile``: one bin of
the log histogram, as a norm computed in float32 may fall in the next bin)."""


def available() -> bool:
    """Whether mlx is installed here: found, not imported. Importing it starts its device, which
    the parent of a pass on worker processes never uses (on CUDA a context of its own, and the
    CUDA libraries mapped: most of such a parent's resident memory)."""

    try:
        return importlib.util.find_spec("mlx.core") is not None
    except ImportError:  # no ``mlx`` package at all
        return False


def device_name() -> str:

    return str(mx.default_device())


@dataclass
class _Pending:
    """A piece of one accumulator whose device results are not folded in yet."""

    acc: RunningSums
    rows: np.ndarray  # (n, dim) as stored (a view): heavy rows of the Gram are added from it
    positions: np.ndarray
    outputs: dict[str, Any]

    def settle(self) -> None:
        self.acc.pending = None
        host = join_results({k: np.array(v)[None] for k, v in self.outputs.items()})
        mlx_fold.fold_group([(self.acc, self.rows, self.positions)], host)


_COMPILED: dict[tuple[bool, ...], Any] = {}


def compiles() -> bool:
    """Whether `piece_function` fuses its operations with ``mx.compile``: ``KVSNAP_MLX_COMPILE``
    (``1`` or ``0``), else only on a Metal GPU. Fusion compiles device kernels at run time, one
    per fused group, shape and dtype: on CUDA (NVRTC) and the CPU build that makes a fresh
    machine's first ``kvsnap stats --backend mlx`` wait for the compiler (cached afterwards); the
    plain operations use kernels mlx ships compiled and give the same bits. Metal compiles its
    fused kernels at once."""

    setting = os.environ.get("KVSNAP_MLX_COMPILE", "")
    if setting not in ("", "0", "1"):
        raise InvalidArgumentError(f"KVSNAP_MLX_COMPILE must be 0 or 1, not {setting!r}")
    if setting:
        return setting == "1"

    return bool(mx.metal.is_available()) and mx.default_device() == mx.gpu


def piece_function(
    norms: bool,
    channels: bool,
    rope: bool,
    mean: bool,
    gram: bool,
    quant: bool,
    batched: bool = False,
    copy: bool = False,
) -> Any:
    """The per-piece computation for one selection of groups (fused where `compiles`);
    ``batched``: over a leading axis of pieces of one shape (``mx.vmap``); ``copy``: float32 rows
    in host memory (`Staging` placement ``host``) are copied into device memory first, so that
    the device reads them over the bus once rather than once per statistic."""
    own_gram = gram and mlx_staging.on_cuda() and _cuda_gram().usable()
    fuse = compiles()
    key = (norms, channels, rope, mean, gram, quant, batched, copy, own_gram, fuse)
    function = _COMPILED.get(key)
    if function is None:
        piece = _piece(norms, channels, rope, mean, gram, quant, copy, own_gram)
        if not norms:  # one input: the rows

            def piece_of_rows(stored: Any) -> dict[str, Any]:
                return piece(stored)

            function = piece_of_rows
        else:  # two: the rows and the position bin of each row, (n,) uint8
            function = piece
        function = mx.vmap(function) if batched else function
        if fuse:
            function = mx.compile(function)
        if own_gram:  # the Gram product by `cuda_gram`, outside the compiled function
            function = _with_gram_product(function, batched)
        _COMPILED[key] = function
    return function


def _cuda_gram() -> Any:
    from . import cuda_gram

    return cuda_gram


def _with_gram_product(function: Callable[..., dict[str, Any]], batched: bool) -> Any:
    """``function``'s outputs with ``shifted`` replaced by its Gram product
    (`cuda_gram.gram_product`)."""
    product = _cuda_gram().gram_product

    def with_product(*inputs: Any) -> dict[str, Any]:
        out = function(*inputs)
        shifted = out.pop("shifted")
        out["product"] = product(shifted) if batched else product(shifted[None])[0]
        return out

    return with_product


def device_hist_edges(squared: bool) -> np.ndarray:
    """``(BINS + 1,)`` float32 bin edges of the log histogram for float32 values (of their square
    roots if ``squared``: squared norms), so the device's bins equal the host's
    (`catalogue.hist_edges`)."""

    return hist_edges(np.float32, squared)


def _piece(
    norms: bool,
    channels: bool,
    rope: bool,
    mean: bool,
    gram: bool,
    quant: bool,
    copy: bool = False,
    own_gram: bool = False,
) -> Any:
    """The per-piece computation (uncompiled) for one selection of groups (``copy``: see
    `piece_function`; ``own_gram``: return the Gram's rows ``shifted`` ``(n, dim)`` float32
    in place of their ``product``, which `cuda_gram.gram_product` computes)."""

    square_edges, peak_edges = (
        mx.array(device_hist_edges(squared=True)),
        mx.array(device_hist_edges(squared=False)),
    )

    flags = (norms, channels, rope, mean, gram, quant)

    def piece(stored: Any, bins: Any = None) -> dict[str, Any]:
        return _piece_sums(stored, bins, flags, (square_edges, peak_edges), copy, own_gram)

    return piece


def _column_sums(a: Any) -> Any:
    """Sums over rows in two levels of at most `SPAN` terms (float32 rounding then grows
    with ~2 sqrt(SPAN), not with the rows, whatever order the device reduces in)."""
    n = a.shape[0]
    full = n - n % SPAN
    total = a[:full].reshape(-1, SPAN, *a.shape[1:]).sum(axis=1).sum(axis=0) if full else None
    if full < n:
        rest = a[full:].sum(axis=0)
        total = rest if total is None else total + rest
    return total


def _group_error(g: Any, levels: int, axis: int) -> Any:
    """Squared errors of min-max quantizing ``g`` along ``axis``, summed per group: the host
    adds the (few) group sums in float64."""
    low = g.min(axis=axis, keepdims=True)
    high = g.max(axis=axis, keepdims=True)
    step = mx.where(high > low, (high - low) / levels, mx.array(1.0, mx.float32))
    restored = mx.round((g - low) * (1.0 / step)) * step + low  # the level as defined
    error = mx.square(restored - g)
    return error.reshape(error.shape[0], -1).sum(axis=1)


def _quant_errors(x: Any) -> tuple[list[Any], list[list[Any]]]:
    """Per bit width: per-row sums of the per-token error ``(n,)``, and per-group sums of
    the per-channel error in one or two parts (whole groups of rows, the rest), to be
    joined on the host (`join_results`)."""
    n, dim = x.shape
    token: list[Any] = []
    channel: list[list[Any]] = []
    for bits in QUANT_BITS:
        levels = (1 << bits) - 1
        full = dim - dim % QUANT_GROUP
        t = _group_error(x[:, :full].reshape(n, -1, QUANT_GROUP), levels, 2) if full else mx.zeros(n)
        if full < dim:
            t = t + _group_error(x[:, full:], levels, 1)
        full = n - n % QUANT_GROUP
        parts = [_group_error(x[:full].reshape(-1, QUANT_GROUP, dim), levels, 1)] if full else []
        if full < n:
            parts.append(_group_error(x[full:][None], levels, 1))
        token.append(t)
        channel.append(parts)
    return token, channel


def _bin_of(values: Any, logs: Any, edges: Any) -> Any:
    """`catalogue.hist_index` of ``values`` (``logs``: their log10), exactly as the host
    computes it in float64: a float32 estimate, then one step down or up against the bin's
    exact float32 edges (`device_hist_edges`)."""
    scaled = (mx.maximum(logs, LOG_LOW) - LOG_LOW) * (BINS / (LOG_HIGH - LOG_LOW))
    scaled = mx.where(scaled == scaled, scaled, 0.0)  # NaN rows: bin 0, an index in range
    estimate = mx.clip(mx.floor(scaled), 0, BINS - 1).astype(mx.int32)
    lower, upper = mx.take(edges, estimate), mx.take(edges, estimate + 1)
    exact = estimate - (values < lower).astype(mx.int32) + (values >= upper).astype(mx.int32)
    # inf and NaN: bin 0, as on the host and in the CPU kernel (and never out of range)
    return mx.where(values < np.inf, mx.clip(exact, 0, BINS - 1), 0)


def _histogram(values: Any, logs: Any, edges: Any) -> Any:
    """``(BINS,)`` int32: how many of ``values`` fall in each bin (`bin_of`)."""
    index = _bin_of(values, logs, edges)
    return mx.zeros((BINS,), mx.int32).at[index].add(mx.ones(index.shape, mx.int32))


def _top_rows(peaks: Any) -> tuple[list[Any], list[Any]]:
    """The rows of the ``k = min(TOP_K, n)`` largest peaks, ties to the later rows (the order
    of `kernel.top_rows`), as two ``(k,)`` int32 index sets padded with -1: the rows above
    the k-th largest peak (fewer than k), and the latest k rows at it (the host takes as
    many as are missing). Non-negative floats order as their bits, NaN above inf, as on
    the host; with their peaks. The k-th largest is the partition's element at ``n - k``
    (no reduction over the partition's strided slice), and the index sets are made
    contiguous by an elementwise op: on CUDA a reduction, stack or host copy of a strided
    array runs mlx's general copy kernels, whose code cost each CUDA worker ~100 MiB of
    host memory (the benchmarks in `benchmarks/`)."""
    n = peaks.shape[0]
    k = min(TOP_K, n)
    bits = peaks.view(mx.int32)
    kth = mx.partition(bits, n - k)[n - k]
    index = mx.arange(n, dtype=mx.int32)
    above = mx.topk(mx.where(bits > kth, index, -1), k) + 0  # + 0: a contiguous copy
    level = mx.topk(mx.where(bits == kth, index, -1), k) + 0
    rows = [above, level]
    return rows, [mx.take(peaks, mx.maximum(r, 0)) for r in rows]


def _piece_sums(
    stored: Any, bins: Any, flags: tuple[bool, ...], edges: tuple[Any, Any], copy: bool, own_gram: bool
) -> dict[str, Any]:
    """`_piece`'s computation of one piece: ``flags`` the groups (norms, channels, rope, mean,
    gram, quant), ``edges`` the histogram edges of squared norms and of peaks."""
    norms, channels, rope, mean, gram, quant = flags
    square_edges, peak_edges = edges
    # float32 rows the device reads over the bus (``copy``): one read into device memory;
    # float16 / bfloat16 cross as stored, and their conversion is the device's copy
    x = stored * 1.0 if copy else stored.astype(mx.float32)
    square = x * x
    sq = square.sum(axis=1)
    out: dict[str, Any] = {"sq_sum": _column_sums(sq)}
    if norms:
        out.update(_norm_sums(x, sq, bins, square_edges))
    if channels or rope or mean:
        out.update(_central_sums(x))
    if channels:
        out.update(_channel_sums(x, peak_edges))
    if gram:
        out.update(_gram_sums(x, sq, own_gram))
    if quant:
        token, channel = _quant_errors(x)
        for bits, (t, parts) in enumerate(zip(token, channel, strict=True)):
            out[f"quant_token:{bits}"] = _column_sums(t)  # the per-row errors summed
            for part, groups in enumerate(parts):
                out[f"quant_channel:{bits}:{part}"] = groups
    return out


def _norm_sums(x: Any, sq: Any, bins: Any, square_edges: Any) -> dict[str, Any]:
    """Everything the host needs of the row norms, folded here: sums, extremes, the histogram bin
    of each row (exact), the norm of the first row, sums per position bin (``bins``)."""
    out: dict[str, Any] = {}
    norm = mx.sqrt(sq)
    out["unit"] = _column_sums(x / mx.maximum(norm, 1e-30)[:, None])
    out["norm_sum"] = _column_sums(norm)
    out["norm_min"], out["norm_max"] = norm.min(), norm.max()
    out["norm_first"] = norm[0] + 0.0  # contiguous when batched (see `_top_rows`)
    out["norm_hist"] = _histogram(sq, 0.5 * mx.log10(sq), square_edges)
    by_bin = bins[:, None] == mx.arange(POSITION_BINS).astype(mx.uint8)[None, :]
    out["position_norm"] = _column_sums(mx.where(by_bin, norm[:, None], 0.0))
    return out


def _central_sums(x: Any) -> dict[str, Any]:
    """Power sums about the piece's own mean (well conditioned in float32 even for a channel
    whose mean is many standard deviations); the host expands them to raw sums in float64
    (`_raw_powers`). In parts, joined on the host (`join_results`): no stack on the device (see
    `_top_rows`)."""
    shift = _column_sums(x) / x.shape[0]
    d = x - shift
    d2 = d * d
    out: dict[str, Any] = {"shift": shift}
    for power, term in enumerate((d, d2, d2 * d, d2 * d2)):
        out[f"central:{power}"] = _column_sums(term)
    return out


def _channel_sums(x: Any, peak_edges: Any) -> dict[str, Any]:
    """Each row's peak ``max |x|``: the rows of the largest (`_top_rows`) and the peaks' histogram;
    each channel's ``max |x|``."""
    out: dict[str, Any] = {}
    magnitude = mx.abs(x)
    peaks = magnitude.max(axis=1)
    rows, row_peaks = _top_rows(peaks)
    for part, (r, p) in enumerate(zip(rows, row_peaks, strict=True)):
        out[f"top_rows:{part}"], out[f"top_peaks:{part}"] = r, p
    out["peak_hist"] = _histogram(peaks, mx.log10(peaks), peak_edges)
    out["absmax"] = magnitude.max(axis=0)
    return out


def _gram_sums(x: Any, sq: Any, own_gram: bool) -> dict[str, Any]:
    """The Gram matrix of the piece's light rows (squared norm at most `HEAVY` times the median)
    about their mean, and what the host needs to add the heavy rows in float64 (``own_gram``:
    the shifted rows instead of their product)."""
    n = x.shape[0]
    ordered = mx.sort(sq)
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    light = (sq <= HEAVY * median).astype(x.dtype)
    light_sums = _column_sums(x * light[:, None])
    center = light_sums / mx.maximum(light.sum(), 1.0)
    shifted = (x - center) * light[:, None]
    heavy = n - light.sum().astype(mx.int32)
    out: dict[str, Any] = {"light": light, "heavy": heavy, "center": center, "light_sums": light_sums}
    if own_gram:
        out["shifted"] = shifted
    else:
        out["product"] = shifted.T @ shifted
    return out


def to_device(rows: np.ndarray) -> Any:
    """``rows`` as an mlx array in their stored type (half the bytes of float32 for 16-bit
    types; the device converts)."""

    if rows.dtype.name == "bfloat16":
        return mx.array(np.ascontiguousarray(rows).view(np.uint16)).view(mx.bfloat16)
    if rows.dtype in (np.float16, np.float32):
        return mx.array(np.ascontiguousarray(rows))
    return mx.array(np.ascontiguousarray(rows, dtype=np.float32))


Flags = tuple[bool, bool, bool, bool, bool, bool]


def piece_flags(acc: RunningSums, n: int) -> Flags:
    """The `piece_function` selection for a piece of ``n`` rows of ``acc``."""
    groups = acc.groups
    return (
        "norms" in groups,
        "channels" in groups,
        "rope" in groups and acc.band is not None,
        "channels" in groups or "spectrum" in groups,
        "spectrum" in groups and n >= GRAM_FLOAT64_ROWS,
        "quant" in groups,
    )


def split_pieces(rows: np.ndarray, positions: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``rows`` in the CPU path's pieces (quantization groups of tokens start at the same rows)."""
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    for start in range(0, rows.shape[0], PIECE):
        piece = rows[start : start + PIECE]
        if piece.shape[0]:
            yield piece, positions[start : start + piece.shape[0]]


NAME = "mlx"


def add(acc: RunningSums, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None) -> None:
    """Start the device computation of ``rows`` ``(n, dim)`` at ``positions``, piece by piece,
    folding in what an earlier `add` left in flight (one accumulator on its own; a pass batches
    many with `Pipeline`). ``check``: the CRC ``rows`` must have, checked first."""

    acc.prepare_add()
    if check is not None:
        check.check(crc32c(bytes_of(rows)))
    rows, positions = acc.drop_nonfinite(rows, positions)
    acc.add_added(rows, positions)
    for x, pos in split_pieces(rows, positions):
        flags = piece_flags(acc, x.shape[0])
        inputs = [to_device(x)] + ([mx.array(piece_bins(pos))] if flags[0] else [])
        outputs = piece_function(*flags)(*inputs)
        mx.async_eval(outputs)
        settle(acc)
        acc.pending = _Pending(acc, x, pos, outputs)


def settle(acc: RunningSums) -> None:
    """Fold the work in flight (if any) into the accumulator's float64 sums."""
    if acc.pending is not None:
        acc.pending.settle()
