"""The statistics of `HeadAccumulator.add` as mlx array operations (``backend="mlx"``): on mlx's
default device, the Metal GPU of a Mac, an NVIDIA GPU with mlx's CUDA build, or the CPU.

Per piece of rows (the CPU path's pieces of `accumulator.PIECE` rows, so quantization groups of tokens
start at the same rows), one compiled mlx function computes on the device everything that
touches every element: row norms (their sums, extremes, sums per position bin and each row's
histogram bin, the same bin the host would pick in float64), peaks, channel power sums up to
the 4th order, channel absmax, the unit-vector sum, the Gram matrix of the rows (less their
mean, massive rows left out; on CUDA by kvsnap's own kernel, `cuda_gram`) and the 8/4/2-bit
quantization errors, and per piece the histograms of the row norms and peaks and the rows of
its top peaks. The host gets back a few
vectors per piece (nothing per row) and folds them into the accumulator's float64 sums; it adds
the Gram matrix of massive rows (few; their mask crosses only when a piece has some) in
float64.

Pipelining: `add` converts the piece, starts its computation (``mx.async_eval``) and returns;
the results are folded in at the accumulator's next `add`, or when its row or a merge needs
them (`settle`), so the next block is read while the device works on this one. Device memory
holds at most two pieces per accumulator in flight (`accumulator.PIECE` rows each, plus outputs).

Precision (the CPU kernel sums in float64): sums run in float32 on the device, in pieces of at
most `accumulator.PIECE` rows, then in float64 on the host; `tests/test_mlx_backend.py` holds every column
to the CPU kernel within `TOLERANCES`.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvformat.checksum import concatenated_linear, crc32c, linear_crc, zeros_crc

from .. import finite
from ..arrays import PIECE, bytes_of
from . import unified_memory

if TYPE_CHECKING:
    from kvformat.reader import PayloadCheck

    from ..accumulator import HeadAccumulator

_SPAN = 64  # rows summed together on the device before the next level

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
    CUDA libraries mapped: 241 of the 408 MiB resident in such a parent in session 18's probe)."""
    import importlib.util

    try:
        return importlib.util.find_spec("mlx.core") is not None
    except ImportError:  # no ``mlx`` package at all
        return False


def device_name() -> str:
    import mlx.core as mx

    return str(mx.default_device())


@dataclass
class _Pending:
    """A piece of one accumulator whose device results are not folded in yet."""

    acc: HeadAccumulator
    rows: np.ndarray  # (n, dim) as stored (a view): heavy rows of the Gram are added from it
    positions: np.ndarray
    outputs: dict[str, Any]

    def settle(self) -> None:
        self.acc.pending = None
        host = _join({k: np.array(v)[None] for k, v in self.outputs.items()})
        _fold_group([(self.acc, self.rows, self.positions)], host)


_COMPILED: dict[tuple[bool, ...], Any] = {}


def _piece_function(
    norms: bool,
    channels: bool,
    rope: bool,
    mean: bool,
    gram: bool,
    quant: bool,
    batched: bool = False,
    copy: bool = False,
) -> Any:
    """The compiled per-piece computation for one selection of groups; ``batched``: over a
    leading axis of pieces of one shape (``mx.vmap``); ``copy``: float32 rows in host memory
    (`Staging` placement ``host``) are copied into device memory first, so that the device
    reads them over the bus once rather than once per statistic."""
    own_gram = gram and _on_cuda() and _cuda_gram().usable()
    key = (norms, channels, rope, mean, gram, quant, batched, copy, own_gram)
    function = _COMPILED.get(key)
    if function is None:
        import mlx.core as mx

        piece = _piece(norms, channels, rope, mean, gram, quant, copy, own_gram)
        if not norms:  # one input: the rows

            def piece_of_rows(stored: Any) -> dict[str, Any]:
                return piece(stored)

            function = piece_of_rows
        else:  # two: the rows and the position bin of each row, (n,) uint8
            function = piece
        function = mx.compile(mx.vmap(function) if batched else function)
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


def _hist_edges(squared: bool) -> np.ndarray:
    """``(BINS + 1,)`` float32 bin edges of the log histogram for float32 values (of their square
    roots if ``squared``: squared norms), so the device's bins equal the host's
    (`catalogue.hist_edges`)."""
    from ..catalogue import hist_edges

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
    `_piece_function`; ``own_gram``: return the Gram's rows ``shifted`` ``(n, dim)`` float32
    in place of their ``product``, which `cuda_gram.gram_product` computes)."""
    import mlx.core as mx

    from ..arrays import HEAVY
    from ..catalogue import (
        BINS,
        LOG_HIGH,
        LOG_LOW,
        POSITION_BINS,
        QUANT_BITS,
        QUANT_GROUP,
        TOP_K,
    )

    square_edges, peak_edges = mx.array(_hist_edges(squared=True)), mx.array(_hist_edges(squared=False))

    def column_sums(a: Any) -> Any:
        """Sums over rows in two levels of at most `_SPAN` terms (float32 rounding then grows
        with ~2 sqrt(_SPAN), not with the rows, whatever order the device reduces in)."""
        n = a.shape[0]
        full = n - n % _SPAN
        total = a[:full].reshape(-1, _SPAN, *a.shape[1:]).sum(axis=1).sum(axis=0) if full else None
        if full < n:
            rest = a[full:].sum(axis=0)
            total = rest if total is None else total + rest
        return total

    def group_error(g: Any, levels: int, axis: int) -> Any:
        """Squared errors of min-max quantizing ``g`` along ``axis``, summed per group: the host
        adds the (few) group sums in float64."""
        low = g.min(axis=axis, keepdims=True)
        high = g.max(axis=axis, keepdims=True)
        step = mx.where(high > low, (high - low) / levels, mx.array(1.0, mx.float32))
        restored = mx.round((g - low) * (1.0 / step)) * step + low  # the level as defined
        error = mx.square(restored - g)
        return error.reshape(error.shape[0], -1).sum(axis=1)

    def quant_errors(x: Any) -> tuple[list[Any], list[list[Any]]]:
        """Per bit width: per-row sums of the per-token error ``(n,)``, and per-group sums of
        the per-channel error in one or two parts (whole groups of rows, the rest), to be
        joined on the host (`_join`)."""
        n, dim = x.shape
        token: list[Any] = []
        channel: list[list[Any]] = []
        for bits in QUANT_BITS:
            levels = (1 << bits) - 1
            full = dim - dim % QUANT_GROUP
            t = group_error(x[:, :full].reshape(n, -1, QUANT_GROUP), levels, 2) if full else mx.zeros(n)
            if full < dim:
                t = t + group_error(x[:, full:], levels, 1)
            full = n - n % QUANT_GROUP
            parts = [group_error(x[:full].reshape(-1, QUANT_GROUP, dim), levels, 1)] if full else []
            if full < n:
                parts.append(group_error(x[full:][None], levels, 1))
            token.append(t)
            channel.append(parts)
        return token, channel

    def bin_of(values: Any, logs: Any, edges: Any) -> Any:
        """`catalogue.hist_index` of ``values`` (``logs``: their log10), exactly as the host
        computes it in float64: a float32 estimate, then one step down or up against the bin's
        exact float32 edges (`_hist_edges`)."""
        scaled = (mx.maximum(logs, LOG_LOW) - LOG_LOW) * (BINS / (LOG_HIGH - LOG_LOW))
        scaled = mx.where(scaled == scaled, scaled, 0.0)  # NaN rows: bin 0, an index in range
        estimate = mx.clip(mx.floor(scaled), 0, BINS - 1).astype(mx.int32)
        lower, upper = mx.take(edges, estimate), mx.take(edges, estimate + 1)
        exact = estimate - (values < lower).astype(mx.int32) + (values >= upper).astype(mx.int32)
        # inf and NaN: bin 0, as on the host and in the CPU kernel (and never out of range)
        return mx.where(values < np.inf, mx.clip(exact, 0, BINS - 1), 0)

    def histogram(values: Any, logs: Any, edges: Any) -> Any:
        """``(BINS,)`` int32: how many of ``values`` fall in each bin (`bin_of`)."""
        index = bin_of(values, logs, edges)
        return mx.zeros((BINS,), mx.int32).at[index].add(mx.ones(index.shape, mx.int32))

    def top_rows(peaks: Any) -> tuple[list[Any], list[Any]]:
        """The rows of the ``k = min(TOP_K, n)`` largest peaks, ties to the later rows (the order
        of `kernel.top_rows`), as two ``(k,)`` int32 index sets padded with -1: the rows above
        the k-th largest peak (fewer than k), and the latest k rows at it (the host takes as
        many as are missing). Non-negative floats order as their bits, NaN above inf, as on
        the host; with their peaks. The k-th largest is the partition's element at ``n - k``
        (no reduction over the partition's strided slice), and the index sets are made
        contiguous by an elementwise op: on CUDA a reduction, stack or host copy of a strided
        array runs mlx's general copy kernels, whose code cost each CUDA worker ~100 MiB of
        host memory (`benchmarks/RESULTS.md`, sessions 20 and 21)."""
        n = peaks.shape[0]
        k = min(TOP_K, n)
        bits = peaks.view(mx.int32)
        kth = mx.partition(bits, n - k)[n - k]
        index = mx.arange(n, dtype=mx.int32)
        above = mx.topk(mx.where(bits > kth, index, -1), k) + 0  # + 0: a contiguous copy
        level = mx.topk(mx.where(bits == kth, index, -1), k) + 0
        rows = [above, level]
        return rows, [mx.take(peaks, mx.maximum(r, 0)) for r in rows]

    def piece(stored: Any, bins: Any = None) -> dict[str, Any]:
        # float32 rows the device reads over the bus (``copy``): one read into device memory;
        # float16 / bfloat16 cross as stored, and their conversion is the device's copy
        x = stored * 1.0 if copy else stored.astype(mx.float32)
        square = x * x
        sq = square.sum(axis=1)
        out: dict[str, Any] = {"sq_sum": column_sums(sq)}
        if norms:
            # Everything the host needs of the row norms, folded here: sums, extremes, the
            # histogram bin of each row (exact), the norm of the first row, sums per position bin.
            norm = mx.sqrt(sq)
            out["unit"] = column_sums(x / mx.maximum(norm, 1e-30)[:, None])
            out["norm_sum"] = column_sums(norm)
            out["norm_min"], out["norm_max"] = norm.min(), norm.max()
            out["norm_first"] = norm[0] + 0.0  # contiguous when batched (see `top_rows`)
            out["norm_hist"] = histogram(sq, 0.5 * mx.log10(sq), square_edges)
            by_bin = bins[:, None] == mx.arange(POSITION_BINS).astype(mx.uint8)[None, :]
            out["position_norm"] = column_sums(mx.where(by_bin, norm[:, None], 0.0))
        if channels or rope or mean:
            # Power sums about the piece's own mean (well conditioned in float32 even for a
            # channel whose mean is many standard deviations); the host expands them to raw
            # sums in float64 (`_raw_powers`).
            shift = column_sums(x) / x.shape[0]
            d = x - shift
            d2 = d * d
            out["shift"] = shift
            # in parts, joined on the host (`_join`): no stack on the device (see `top_rows`)
            for power, term in enumerate((d, d2, d2 * d, d2 * d2)):
                out[f"central:{power}"] = column_sums(term)
        if channels:
            magnitude = mx.abs(x)
            peaks = magnitude.max(axis=1)
            rows, row_peaks = top_rows(peaks)
            for part, (r, p) in enumerate(zip(rows, row_peaks, strict=True)):
                out[f"top_rows:{part}"], out[f"top_peaks:{part}"] = r, p
            out["peak_hist"] = histogram(peaks, mx.log10(peaks), peak_edges)
            out["absmax"] = magnitude.max(axis=0)
        if gram:
            n = x.shape[0]
            ordered = mx.sort(sq)
            median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
            light = (sq <= HEAVY * median).astype(x.dtype)
            weighted = x * light[:, None]
            light_sums = column_sums(weighted)
            center = light_sums / mx.maximum(light.sum(), 1.0)
            shifted = (x - center) * light[:, None]
            heavy = n - light.sum().astype(mx.int32)
            out.update(light=light, heavy=heavy, center=center, light_sums=light_sums)
            if own_gram:
                out["shifted"] = shifted
            else:
                out["product"] = shifted.T @ shifted
        if quant:
            token, channel = quant_errors(x)
            for bits, (t, parts) in enumerate(zip(token, channel, strict=True)):
                out[f"quant_token:{bits}"] = column_sums(t)  # the per-row errors summed
                for part, groups in enumerate(parts):
                    out[f"quant_channel:{bits}:{part}"] = groups
        return out

    return piece


def _to_device(rows: np.ndarray) -> Any:
    """``rows`` as an mlx array in their stored type (half the bytes of float32 for 16-bit
    types; the device converts)."""
    import mlx.core as mx

    if rows.dtype.name == "bfloat16":
        return mx.array(np.ascontiguousarray(rows).view(np.uint16)).view(mx.bfloat16)
    if rows.dtype in (np.float16, np.float32):
        return mx.array(np.ascontiguousarray(rows))
    return mx.array(np.ascontiguousarray(rows, dtype=np.float32))


Flags = tuple[bool, bool, bool, bool, bool, bool]


def _flags(acc: HeadAccumulator, n: int) -> Flags:
    """The `_piece_function` selection for a piece of ``n`` rows of ``acc``."""
    from ..arrays import GRAM_FLOAT64_ROWS

    groups = acc.groups
    return (
        "norms" in groups,
        "channels" in groups,
        "rope" in groups and acc.band is not None,
        "channels" in groups or "spectrum" in groups,
        "spectrum" in groups and n >= GRAM_FLOAT64_ROWS,
        "quant" in groups,
    )


def _pieces(rows: np.ndarray, positions: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``rows`` in the CPU path's pieces (quantization groups of tokens start at the same rows)."""
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    for start in range(0, rows.shape[0], PIECE):
        piece = rows[start : start + PIECE]
        if piece.shape[0]:
            yield piece, positions[start : start + piece.shape[0]]


NAME = "mlx"


def add(
    acc: HeadAccumulator, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None
) -> None:
    """Start the device computation of ``rows`` ``(n, dim)`` at ``positions``, piece by piece,
    folding in what an earlier `add` left in flight (one accumulator on its own; a pass batches
    many with `Pipeline`). ``check``: the CRC ``rows`` must have, checked first."""
    import mlx.core as mx

    acc.prepare_add()
    if check is not None:
        check.check(crc32c(bytes_of(rows)))
    rows, positions = acc.drop_nonfinite(rows, positions)
    for x, pos in _pieces(rows, positions):
        flags = _flags(acc, x.shape[0])
        inputs = [_to_device(x)] + ([mx.array(_piece_bins(pos))] if flags[0] else [])
        outputs = _piece_function(*flags)(*inputs)
        mx.async_eval(outputs)
        settle(acc)
        acc.pending = _Pending(acc, x, pos, outputs)


class _Batch:
    """Pieces of many accumulators sent to the device together: per group of pieces of one
    shape, dtype and selection, one call of the batched function on the pieces stacked on the
    device (each piece is copied to the device once, straight from the file's pages).

    Life: copied (`__init__`, on the driving thread: the copies into staging buffers start on the
    copy threads and run while the driver reads the next batch), launched (`launch`: waits for
    the copies, runs ``after`` (releasing the pages copied), starts the device), fetched (`fetch`:
    the driving thread waits for the device and copies the small results to the host), folded
    (`_fold_all`, on the pipeline's fold thread, batches in the order they were sent)."""

    def __init__(
        self,
        entries: list[tuple[HeadAccumulator, np.ndarray, np.ndarray, Any]],
        folder: ThreadPoolExecutor,
        staging: Staging | None = None,
        after: list[Callable[[], None]] | None = None,
    ) -> None:
        self.folder = folder
        self.staging = staging
        self.after = after or []
        groups: dict[tuple[Any, str, Flags], list[int]] = {}
        for i, (acc, x, _, _) in enumerate(entries):
            groups.setdefault((x.shape, x.dtype.str, _flags(acc, x.shape[0])), []).append(i)
        self.entries = [(acc, x, pos) for acc, x, pos, _ in entries]
        self.groups = [(flags, members) for (_, _, flags), members in groups.items()]
        self.fills = [
            staging.start_fill([entries[i][1] for i in members], [entries[i][3] for i in members])
            if staging is not None
            else None
            for _, members in self.groups
        ]
        self.calls: list[tuple[list[int], dict[str, Any]]] = []
        self.buffers: list[Any] = []
        self._launched = False
        self._lock = threading.Lock()
        self._folded: Future[None] | None = None
        self._marks: list[Future[None]] = []  # done once this batch is folded (`Pipeline.mark`)
        self._settled = False
        self._error: BaseException | None = None  # why it was not folded
        for acc, _, _, _ in entries:
            acc.pending = self

    def launch(self) -> None:
        """Wait for the copies, release what they read, start the device (idempotent; on the
        driving thread)."""
        import mlx.core as mx

        if self._launched:
            return
        self._launched = True
        entries = self.entries
        for (flags, members), fill in zip(self.groups, self.fills, strict=True):
            copy = False
            if fill is not None:
                buffer, stacked = fill.result()
                self.buffers.append(buffer)
                copy = fill.remote and stacked.dtype == mx.float32
            else:
                stacked = mx.stack([_to_device(entries[i][1]) for i in members])
            inputs = [stacked]
            if flags[0]:  # the position bin of every row of every piece, (pieces, n) uint8
                inputs.append(mx.array(np.stack([_piece_bins(entries[i][2]) for i in members])))
            outputs = _piece_function(*flags, batched=True, copy=copy)(*inputs)
            self.calls.append((members, outputs))
        self.fills = []
        for after in self.after:
            after()
        self.after = []
        mx.async_eval([outputs for _, outputs in self.calls])

    def fetch(self) -> Future[None]:
        """Wait for the device, copy the results to the host and queue the folding on the fold
        thread (after the batches fetched before this one); returns the folding's future.
        Idempotent."""
        self.launch()
        with self._lock:
            if self._folded is None:
                results = [(members, _to_host(outputs)) for members, outputs in self.calls]
                self.calls = []
                if self.staging is not None:  # the device has read them: free for the next batch
                    self.staging.give_back(self.buffers)
                self.buffers = []
                self._folded = self.folder.submit(self._fold_all, results)
            return self._folded

    def _fold_all(self, results: list[tuple[list[int], dict[str, np.ndarray]]]) -> None:
        # Group by group (pieces of one shape and selection), each group's pieces in order; an
        # accumulator's pieces all fall in one group (one shape per head), so each accumulator
        # sums its pieces in the order they were added.
        try:
            for members, host in results:
                _fold_group([self.entries[i] for i in members], host)
            for acc, _, _ in self.entries:
                if acc.pending is self:
                    acc.pending = None
        except BaseException as exc:
            self.settle_marks(exc)
            raise
        self.settle_marks(None)

    def add_mark(self, mark: Future[None]) -> None:
        """Complete ``mark`` once this batch is folded (at once if it is)."""
        with self._lock:
            if not self._settled:
                self._marks.append(mark)
                return
        _complete(mark, self._error)

    def settle_marks(self, error: BaseException | None) -> None:
        """This batch is folded (``error``: or failed, or was dropped): complete its marks."""
        with self._lock:
            if self._settled:
                return
            self._settled, self._error = True, error
            marks, self._marks = self._marks, []
        for mark in marks:
            _complete(mark, error)

    def fold(self) -> None:
        """Everything of this batch folded in (and so every batch sent before it)."""
        self.fetch().result()

    settle = fold  # an accumulator's `Pending`


class PipelineAbandoned(RuntimeError):
    """The pipeline stopped (after a failure) before this work was folded in."""


def _complete(mark: Future[None], error: BaseException | None) -> None:
    if mark.done():
        return
    if error is None:
        mark.set_result(None)
    else:
        mark.set_exception(error)


PLACEMENT = "host"
"""Where staging buffers live on CUDA (`unified_memory.MODES`; ``KVSNAP_MLX_STAGING`` overrides):
in host memory, the device reading them in place. On the H200 machine, full catalogue, 12
processes, second passes: bf16 0.36 -> 0.23 s, fp32 1.66 -> 0.92 s against the driver's default
(``fault``: pages moved on demand, both ways, at each reuse); ``prefetch`` gave 0.29 s on bf16 and
``mostly`` 0.2-0.7 GB/s in `benchmarks/mlx_copy_probe.py` (`benchmarks/RESULTS.md`, session 16)."""


def _on_cuda() -> bool:
    """Whether mlx computes on a CUDA device here."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return cuda is not None and bool(cuda.is_available()) and mx.default_device() == mx.gpu


class Staging:
    """Device buffers the host writes batches into, on many threads.

    ``mx.array(rows)`` copies on one thread, holding the GIL: 2.5 GB/s on the H200 machine
    (`benchmarks/mlx_copy_probe.py`). An evaluated mlx array exposes its memory through the
    buffer protocol (CUDA managed memory, or Apple's unified memory), so the pieces of a batch are
    copied straight into it with ``np.copyto`` on a thread pool (which releases the GIL): 7.2-7.9
    GB/s there on 8-16 threads, the device's reads included (a pass uses `copy_threads`).
    Buffers are reused once the device has read them (`give_back`); at most three per shape are
    kept (a batch copying, one on the device, one being fetched). `create` checks once that a
    write through the buffer is what the device reads, and returns None where it is not (then
    batches go through ``mx.array``).

    On CUDA that memory is managed memory, and by default its pages move on demand: the device
    faults each batch in (~0.57 GB/s per process), the host faults it back at its next write.
    ``placement`` (`PLACEMENT`) keeps the buffers in host memory instead, the device reading them
    in place over the bus (`unified_memory`): 12-14 GB/s for one process in
    `benchmarks/mlx_copy_probe.py` against 4.8 GB/s by faults. Float32 rows are then copied to
    device memory once per call (`_piece_function` ``copy``); 16-bit rows already are, by their
    conversion."""

    KEEP_BYTES = 256 << 20

    def __init__(self, threads: int, placement: str | None = None) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvsnap-mlx-copy")
        self.threads = threads
        self.free: dict[tuple[tuple[int, ...], str], list[Any]] = {}  # (shape, dtype name)
        self.placement = placement or os.environ.get("KVSNAP_MLX_STAGING", PLACEMENT)
        if self.placement not in unified_memory.MODES:
            raise ValueError(
                f"KVSNAP_MLX_STAGING={self.placement!r}: one of {', '.join(unified_memory.MODES)}"
            )
        self.memory = (
            unified_memory.UnifiedMemory.load() if self.placement != "fault" and _on_cuda() else None
        )
        self.managed: dict[int, bool] = {}  # buffer address: in managed memory (hints set)

    @classmethod
    def create(cls, threads: int | None = None) -> Staging | None:
        import mlx.core as mx

        try:
            probe = mx.zeros((64,), dtype=mx.float32)
            mx.eval(probe)
            view = _host_view(probe)
            if not view.flags.writeable or view.shape != (64,):
                return None
            view[:] = np.arange(64, dtype=np.float32)
            if float(np.array((probe * 2).sum())) != float(np.arange(64).sum() * 2):
                return None
        except (TypeError, ValueError, BufferError, RuntimeError):
            return None
        return cls(threads or copy_threads())

    def _take(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import mlx.core as mx

        free = self.free.get((shape, str(dtype)))
        if free:
            return free.pop()
        buffer = mx.zeros(shape, dtype=dtype)
        mx.eval(buffer)
        if self.memory is not None:
            address = _host_view(buffer).ctypes.data
            managed = self.managed[address] = self.memory.is_managed(address)
            if managed:
                try:
                    self.memory.place(address, buffer.nbytes, self.placement)
                except unified_memory.UnifiedMemoryError as exc:
                    self._give_up(exc)
        return buffer

    def _give_up(self, error: Exception) -> None:
        """A placement hint failed: the pass goes on without hints (they only move pages)."""
        warnings.warn(f"mlx staging placement {self.placement!r} off: {error}", RuntimeWarning, stacklevel=3)
        self.memory = None
        self.managed.clear()

    def fill(self, pieces: list[np.ndarray]) -> tuple[Any, Any]:
        """``(buffer, stacked)``: ``pieces`` (same shape and dtype) copied into one device buffer
        ``(len(pieces), *shape)``; ``stacked`` is it in the pieces' type (16-bit types stay 16-bit:
        the device converts)."""
        return self.start_fill(pieces).result()

    def start_fill(self, pieces: list[np.ndarray], checks: list[Any] | None = None) -> _Fill:
        """`fill`, started: the copies run on the copy threads; ``.result()`` waits for them.
        ``checks``: per piece, None or a `kvformat.reader.PayloadCheck` its bytes must pass; the
        copy threads compute the CRC of what they copy (the linear CRC of each task's rows,
        combined per piece by `kvformat.checksum`), ``.result()`` checks it."""
        import mlx.core as mx

        first = pieces[0]
        sixteen = first.dtype.name in ("bfloat16", "float16")
        shape = (len(pieces), *first.shape)
        buffer = self._take(shape, mx.uint16 if sixteen else mx.float32)
        target = _host_view(buffer)
        rows = first.shape[0]
        step = max(1, -(-rows * len(pieces) // (self.threads * 2)))  # ~2 tasks per thread
        checks = checks or [None] * len(pieces)

        def copy(index: int, start: int) -> int:
            source = pieces[index][start : start + step]
            if sixteen:
                np.copyto(target[index, start : start + step], source.view(np.uint16))
            else:
                np.copyto(target[index, start : start + step], source, casting="unsafe")
            return linear_crc(bytes_of(source)) if checks[index] is not None else 0

        tasks = [(i, start) for i in range(len(pieces)) for start in range(0, rows, step)]
        copies = [self.pool.submit(copy, i, start) for i, start in tasks]
        task_bytes = [min(step, rows - start) * first[0].nbytes for _, start in tasks]
        verify = _CopyCheck(checks, [i for i, _ in tasks], task_bytes)
        stacked = buffer
        if first.dtype.name == "bfloat16":
            stacked = buffer.view(mx.bfloat16)
        elif first.dtype == np.float16:
            stacked = buffer.view(mx.float16)
        address = target.ctypes.data
        managed = self.managed.get(address, False)
        prefetch = self.memory if managed and self.placement in ("prefetch", "mostly") else None
        remote = managed and self.placement == "host"
        return _Fill(copies, buffer, stacked, verify, prefetch, address, remote)

    def give_back(self, buffers: list[Any]) -> None:
        """Buffers the device has finished reading: kept for reuse, at most three per shape and
        `KEEP_BYTES` in all (the rest are freed)."""
        for buffer in buffers:
            kept = self.free.setdefault((tuple(buffer.shape), str(buffer.dtype)), [])
            held = sum(b.nbytes for free in self.free.values() for b in free)
            if len(kept) < 3 and held + buffer.nbytes <= self.KEEP_BYTES:
                kept.append(buffer)
            else:
                self._release(buffer)

    def _release(self, buffer: Any) -> None:
        """Clear the placement hints of a buffer about to be freed: mlx reuses freed memory for
        its own arrays, which belong in device memory."""
        if self.memory is not None:
            address = _host_view(buffer).ctypes.data
            if self.managed.pop(address, False):
                try:
                    self.memory.unplace(address, buffer.nbytes, self.placement)
                except unified_memory.UnifiedMemoryError as exc:
                    self._give_up(exc)

    def close(self) -> None:
        self.pool.shutdown()
        for free in self.free.values():
            for buffer in free:
                self._release(buffer)
        self.free.clear()


@dataclass
class _CopyCheck:
    """The payload checks of the pieces of one fill: per piece its check (or None); per copy
    task, its piece and bytes, in order."""

    checks: list[Any]
    task_piece: list[int]
    task_bytes: list[int]

    def check(self, parts: list[int]) -> None:
        """Raise `kvformat.ChecksumError` for the first piece whose tasks' linear CRCs
        (``parts``, per task) do not combine to its payload's CRC."""
        pieces: dict[int, list[tuple[int, int]]] = {}
        for piece, nbytes, part in zip(self.task_piece, self.task_bytes, parts, strict=True):
            if self.checks[piece] is not None:
                pieces.setdefault(piece, []).append((nbytes, part))
        for piece, spans in pieces.items():
            crc = concatenated_linear(spans) ^ zeros_crc(sum(nbytes for nbytes, _ in spans))
            self.checks[piece].check(crc)


@dataclass
class _Fill:
    """Copies into a staging buffer in progress: `result` waits for them (and raises what one of
    them raised, or a payload CRC that does not match), then gives ``(buffer, stacked)``."""

    copies: list[Future[int]]
    buffer: Any
    stacked: Any
    verify: _CopyCheck | None = None
    prefetch: Any = None  # a `unified_memory.UnifiedMemory` that moves the buffer to the device
    address: int = 0
    remote: bool = False  # the device reads the buffer in host memory, over the bus

    def result(self) -> tuple[Any, Any]:
        parts = [future.result() for future in self.copies]
        if self.verify is not None:
            self.verify.check(parts)
            self.verify = None
        if self.prefetch is not None:
            try:
                self.prefetch.prefetch(self.address, self.buffer.nbytes)
            except unified_memory.UnifiedMemoryError as exc:  # a hint: the device faults the pages in
                warnings.warn(f"mlx staging prefetch off: {exc}", RuntimeWarning, stacklevel=2)
            self.prefetch = None
        return self.buffer, self.stacked


PROCESS_SHARE = 3 / 4
"""Worker processes an mlx pass over a local file uses, per worker asked for (`analysis.processes`):
each drives the device with its own pipeline, so the host's work (copies, checksums, folding,
rows) runs outside one interpreter's lock. On the H200 machine's 16 cores the full catalogue's
second pass over the 8.6 GB fp32 file took 3.66 s in one process, 2.65 s on 4 worker processes,
1.93 s on 10, 1.63-1.65 s on 12 and 2.25 s on 16 (`benchmarks/RESULTS.md`, session 14)."""

PROCESS_MEMORY = 8 << 30
"""Bytes of the machine's memory per such process, at most: each holds its own mlx and device
context (on CUDA 0.90-0.93 GiB resident at its peak, ~1.4 GiB where it compiles the kernels,
most of it its own), so a machine with little memory runs few."""


def processes(workers: int) -> int:
    """Worker processes for an mlx pass asked to use ``workers`` workers: 3/4 of them (12 of 16),
    at most one per `PROCESS_MEMORY` of physical memory; 1 (the pass stays in this process) on
    small machines and off Linux. macOS stays in one process: worker processes that each start
    Metal are measured and tested nowhere yet."""
    if not sys.platform.startswith("linux"):
        return 1
    return max(1, min(int(workers * PROCESS_SHARE), _physical_memory() // PROCESS_MEMORY))


def _physical_memory() -> int:
    """The machine's physical memory in bytes (Linux and macOS); a large number where unknown."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 1 << 50


def copy_threads(share: int = 1) -> int:
    """Threads that copy batches into staging buffers: 3/8 of the cores (6 of 16), divided among
    ``share`` processes that drive the device. More lose: on the H200 machine's 16 cores, beside
    the driving thread, the fold thread, the row threads (`row_threads`) and mlx's own, a full
    pass took 5.4 s (fp32, 8.6 GB) with 16 copy threads and 3.6-4.2 s with 6
    (`benchmarks/RESULTS.md`, session 11)."""
    from ..parallel import cores

    return max(1, min(16, cores() * 3 // 8) // share)


def row_threads(share: int = 1) -> int:
    """Threads that compute the rows (eigenvalues and all) of an mlx pass's accumulators as
    their layers end: a quarter of the cores (see `copy_threads`), divided among ``share``
    processes."""
    from ..parallel import cores

    return max(1, cores() // 4 // share)


BATCH_MIB = 32
"""Stored rows per device call (`Pipeline`) in a pass that drives the device from one process,
MiB; ``KVSNAP_MLX_BATCH_MIB`` overrides it and `WORKER_BATCH_MIB`."""

WORKER_BATCH_MIB = 16
"""The same in each of a pass's worker processes (`analysis.processes`), where a process's host
memory is what counts (on CUDA the staging buffers live there). H200, 12 processes, fp32 file
(`benchmarks/RESULTS.md`, session 20): the largest worker 1052 -> 1002 MiB (``VmHWM``)
against 32 MiB batches, the pass 0.85-0.90 -> 1.02-1.16 s; in one process 16 MiB cost more
(fp32 2.91 -> 3.97 s, bf16 0.57 -> 0.85 s) and saved nothing that reaches 1 GiB there."""


def batch_bytes(worker: bool = False) -> int:
    """`BATCH_MIB`, or `WORKER_BATCH_MIB` for a ``worker`` process (or ``KVSNAP_MLX_BATCH_MIB``,
    a whole number of MiB from 1 to 4096), in bytes."""
    text = os.environ.get("KVSNAP_MLX_BATCH_MIB", "").strip()
    if not text:
        return (WORKER_BATCH_MIB if worker else BATCH_MIB) << 20
    if not text.isdigit() or not 1 <= int(text) <= 4096:
        raise ValueError(f"KVSNAP_MLX_BATCH_MIB={text!r}: a whole number of MiB from 1 to 4096")
    return int(text) << 20


def _host_view(array: Any) -> np.ndarray:
    """The memory of an evaluated mlx array as a numpy array (no copy where mlx allows it)."""
    return np.asarray(memoryview(array))


class Pipeline:
    """Batches the pieces a pass adds into device calls of about ``limit`` bytes (`_Batch`):
    one batch copied into staging buffers (copy threads) while the next is read, the one before
    it on the device, results folded into the accumulators on one fold thread (in order) while
    the device works on the next. A pass marks each layer's end (`mark`) rather than draining
    the pipeline there: the layer's rows are computed once its mark is done, while the next
    layers are read, copied and computed. Device memory: two batches' staging buffers
    (``2 x limit``, `flush`), one batch's float32 copies and outputs; host memory: the results of
    the batches waiting for the fold thread (a few vectors and a ``dim x dim`` matrix per
    piece)."""

    def __init__(
        self, limit: int | None = None, staging: bool = True, copy_threads: int | None = None
    ) -> None:
        self.limit = batch_bytes() if limit is None else limit
        self._staging = Staging.create(copy_threads) if staging else None
        self._entries: list[tuple[HeadAccumulator, np.ndarray, np.ndarray, Any]] = []
        self._after: list[Callable[[], None]] = []
        self._bytes = 0
        self._copying: _Batch | None = None  # copies running while the next batch is read
        self._in_flight: _Batch | None = None  # on the device
        self._folder = ThreadPoolExecutor(1, thread_name_prefix="kvsnap-mlx-fold")
        self._folding: collections.deque[Future[None]] = collections.deque()
        self._marks: list[Future[None]] = []  # for the batch the queued pieces will form
        self._newest: _Batch | None = None

    def add(
        self,
        acc: HeadAccumulator,
        rows: np.ndarray,
        positions: np.ndarray,
        after: Callable[[], None] | None = None,
        check: Any = None,
    ) -> None:
        """Queue ``rows`` of ``acc``; ``after`` runs once they are copied for the device (e.g.
        releasing their pages). ``check``: a `kvformat.reader.PayloadCheck` the bytes of
        ``rows`` (a chunk's whole payload, read unchecked) must pass: the copy threads compute
        the CRC over what they copy, so the driving thread reads nothing itself (checked here
        instead when ``rows`` span several pieces or nothing is staged)."""
        acc.prepare_add()
        if check is not None and (rows.shape[0] > PIECE or self._staging is None):
            check.check(crc32c(bytes_of(rows)))
            check = None
        if finite.any_nonfinite(rows):  # rare: checked, then the rows with inf or NaN left out
            if check is not None:
                check.check(crc32c(bytes_of(rows)))
                check = None
            rows, positions = acc.drop_nonfinite(rows, positions)
        for x, pos in _pieces(rows, positions):
            self._entries.append((acc, x, pos, check))
            self._bytes += x.nbytes
        if after is not None:
            self._after.append(after)
        if self._bytes >= self.limit:
            self.flush()

    def flush(self) -> None:
        """Launch the batch copied before (its copies ran while this one was read), fetch the
        batch launched before that and queue its folding, then start copying what is queued.
        In that order: the fetched batch's staging buffers are free again and the launched
        batch's file pages released before this one's copies take a buffer and map pages, so
        a pass holds two batches' staging buffers and one batch's pages, not three and two."""
        launching, self._copying = self._copying, None
        if launching is not None:
            self._launch(launching)
        batch = _Batch(self._entries, self._folder, self._staging, self._after) if self._entries else None
        if batch is None:
            for after in self._after:
                after()
        else:
            self._newest = batch
            for mark in self._marks:
                batch.add_mark(mark)
            self._marks = []
        self._entries, self._after, self._bytes = [], [], 0
        self._copying = batch
        while len(self._folding) > 2:  # bounded host memory: results wait for the fold thread
            self._folding.popleft().result()

    def _launch(self, batch: _Batch) -> None:
        batch.launch()
        previous, self._in_flight = self._in_flight, batch
        if previous is not None:
            self._folding.append(previous.fetch())

    def mark(self) -> Future[None]:
        """A future done once everything added so far is folded into its accumulators (its
        exception: the fold's, or `PipelineAbandoned`). Unlike `finish` nothing waits: the pieces
        added next are read and copied while these are on the device (a pass marks each layer's
        end, and computes the layer's rows once its mark is done)."""
        mark: Future[None] = Future()
        if self._entries:
            self._marks.append(mark)
        elif self._newest is not None:
            self._newest.add_mark(mark)
        else:
            mark.set_result(None)
        return mark

    def wait(self, mark: Future[None]) -> None:
        """Until ``mark`` (`mark`) is done, its exception raised: the driving thread moves the
        batches on, oldest first, only as far as the mark needs (its pieces may still be queued,
        copying or on the device)."""
        while not mark.done():
            if self._folding:
                self._folding.popleft().result()
            elif self._in_flight is not None:
                self._folding.append(self._in_flight.fetch())
                self._in_flight = None
            elif self._copying is not None:
                batch, self._copying = self._copying, None
                self._launch(batch)
            elif self._entries:
                self.flush()
            else:
                break
        mark.result()

    def finish(self) -> None:
        """Send what is queued and fold everything: every accumulator is up to date."""
        self.flush()
        if self._copying is not None:
            batch, self._copying = self._copying, None
            self._launch(batch)
        if self._in_flight is not None:
            self._folding.append(self._in_flight.fetch())
            self._in_flight = None
        while self._folding:
            self._folding.popleft().result()
        self._newest = None  # folded, its marks done: its pieces (views of mapped files) can go

    def close(self) -> None:
        """Finish, then stop the fold thread."""
        try:
            self.finish()
        finally:
            self._folder.shutdown()
            if self._staging is not None:
                self._staging.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:  # a failure (a bad CRC, say)
            self.abandon()

    def abandon(self) -> None:
        """Stop without finishing what is queued (after a failure); marks not done yet fail with
        `PipelineAbandoned`."""
        self._folder.shutdown()
        if self._staging is not None:
            self._staging.close()
        dropped = PipelineAbandoned("the mlx pipeline stopped before this work was folded in")
        for mark in self._marks:
            _complete(mark, dropped)
        self._marks = []
        for batch in (self._copying, self._in_flight, self._newest):
            if batch is not None:
                batch.settle_marks(dropped)


def _to_host(outputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """A call's outputs copied to host memory (parts joined, `_join`); the per-row mask
    ``light`` only when a piece has heavy rows (rare: the host then adds their Gram in
    float64)."""
    host = {name: np.array(value) for name, value in outputs.items() if name != "light"}
    if "light" in outputs and host["heavy"].any():
        host["light"] = np.array(outputs["light"])
    return _join(host)


def _join(host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs the device returns in parts, joined (the device stacks nothing: on CUDA that
    runs mlx's general copy kernels, `_piece`'s ``top_rows``), batched ``(B, ...)`` or not:
    ``central`` ``(..., 4, dim)`` from ``central:p``; ``top_rows`` and ``top_peaks``
    ``(..., 2, k)``; ``quant_token`` ``(..., bits)`` from ``quant_token:b``; ``quant_channel``
    ``(..., bits, groups)`` from ``quant_channel:b:i`` (a bit width's groups in parts)."""
    parts: dict[str, dict[tuple[int, ...], np.ndarray]] = {}
    for key in [key for key in host if ":" in key]:
        name, *index = key.split(":")
        parts.setdefault(name, {})[tuple(int(i) for i in index)] = host.pop(key)
    for name, pieces in parts.items():
        if name == "quant_channel":
            widths = sorted({index[0] for index in pieces})
            joined = [
                np.concatenate([pieces[i] for i in sorted(i for i in pieces if i[0] == b)], axis=-1)
                for b in widths
            ]
            host[name] = np.stack(joined, axis=-2)
        else:
            ordered = [pieces[index] for index in sorted(pieces)]
            host[name] = np.stack(ordered, axis=-1 if name == "quant_token" else -2)
    return host


def _raw_powers(shift: np.ndarray, central: np.ndarray, n: int) -> np.ndarray:
    """``(..., 4, dim)`` float64 sums of x, x^2, x^3, x^4 from sums of ``d = x - shift``
    (``central`` ``(..., 4, dim)``; binomial expansion; ``shift`` ``(..., dim)`` is exactly the
    float32 value the device subtracted)."""
    c = shift.astype(np.float64)
    s1, s2, s3, s4 = np.moveaxis(central.astype(np.float64), -2, 0)
    return np.stack(
        [
            s1 + n * c,
            s2 + 2 * c * s1 + n * c**2,
            s3 + 3 * c * s2 + 3 * c**2 * s1 + n * c**3,
            s4 + 4 * c * s3 + 6 * c**2 * s2 + 4 * c**3 * s1 + n * c**4,
        ],
        axis=-2,
    )


def settle(acc: HeadAccumulator) -> None:
    """Fold the work in flight (if any) into the accumulator's float64 sums."""
    if acc.pending is not None:
        acc.pending.settle()


def _piece_bins(positions: np.ndarray) -> np.ndarray:
    """`catalogue.position_bins` of a piece's positions as uint8 (the device's input); for a run
    (every head of a layer holds the same positions) computed once and cached."""
    from ..catalogue import position_bins

    n = positions.size
    if n and int(positions[-1]) - int(positions[0]) == n - 1:
        return _run_bins(int(positions[0]), n)[0]
    return position_bins(positions).astype(np.uint8)


def _piece_bin_counts(positions: np.ndarray) -> np.ndarray:
    """How many of a piece's positions fall in each position bin, ``(POSITION_BINS,)`` int64."""
    from ..catalogue import POSITION_BINS

    n = positions.size
    if n and int(positions[-1]) - int(positions[0]) == n - 1:
        return _run_bins(int(positions[0]), n)[1]
    return np.bincount(_piece_bins(positions), minlength=POSITION_BINS)


@functools.lru_cache(maxsize=64)
def _run_bins(start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The uint8 bins of positions ``start .. start + count - 1`` and their counts per bin
    (read-only, cached)."""
    from ..catalogue import POSITION_BINS, position_bins

    bins = position_bins(np.arange(start, start + count, dtype=np.int64)).astype(np.uint8)
    counts = np.bincount(bins, minlength=POSITION_BINS)
    bins.flags.writeable = counts.flags.writeable = False
    return bins, counts


def _top_found(
    rows: list[list[int]], peaks: list[list[float]], positions: np.ndarray
) -> list[tuple[float, int]]:
    """A piece's top peaks as ``(peak, position)`` from the device's `top_rows` index sets
    (``rows``, ``peaks``: ``(2, k)``): every row above the k-th largest peak, then the latest
    rows at it until there are k."""
    (above, level), (above_peaks, level_peaks) = rows, peaks
    k = len(above)
    found = [(peak, int(positions[i])) for i, peak in zip(above, above_peaks, strict=True) if i >= 0]
    at_level = sorted(((i, peak) for i, peak in zip(level, level_peaks, strict=True) if i >= 0), reverse=True)
    found += [(peak, int(positions[i])) for i, peak in at_level[: k - len(found)]]
    return found


def _shared_stack(
    entries: list[tuple[HeadAccumulator, np.ndarray, np.ndarray]],
) -> tuple[dict[str, np.ndarray], slice | np.ndarray] | None:
    """The stacked sums (`accumulator.stack`) of which every entry's accumulator is a different
    row, with all its sums still views of them (`HeadAccumulator.merge` rebinds them), and the
    entries' rows there (a slice where they follow each other); None otherwise (then the group
    adds one accumulator at a time, in order: e.g. a head with two pieces in one batch)."""
    from ..accumulator import STACKED

    shared = entries[0][0].layout
    if shared is None:
        return None
    slots = []
    for acc, _, _ in entries:
        if acc.layout is not shared:
            return None
        if any(getattr(acc, name).base is not shared.arrays[name] for name in STACKED):
            return None
        slots.append(acc.slot)
    if len(set(slots)) < len(slots):
        return None
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        return shared.arrays, slice(first, first + len(slots))
    return shared.arrays, np.array(slots)


def _fold_group(
    entries: list[tuple[HeadAccumulator, np.ndarray, np.ndarray]], out: dict[str, np.ndarray]
) -> None:
    """Add the device results of pieces of one shape and selection to their accumulators, in
    order: ``entries`` ``(acc, x, pos)`` (``x`` a piece as stored, ``pos`` its positions),
    ``out`` host arrays with a leading axis over the entries. What is left per row here is
    counting histogram bins the device chose and picking the top peaks; it runs once for the
    group, not once per piece: on the H200 the per-piece calls, under the GIL beside the thread
    that drives the device, were most of the fold."""
    from .. import catalogue
    from ..arrays import float32_rows

    groups = entries[0][0].groups
    n = entries[0][1].shape[0]
    # Per-piece scalars as Python floats, vectors in float64: whole-group conversions, so the
    # loop below is a few adds per accumulator.
    square_sums = out["sq_sum"].astype(np.float64).tolist()
    if "norms" in groups:
        norm_sums = out["norm_sum"].astype(np.float64).tolist()
        norm_mins = out["norm_min"].astype(np.float64).tolist()
        norm_maxs = out["norm_max"].astype(np.float64).tolist()
        norm_firsts = out["norm_first"].astype(np.float64).tolist()
        norm_hists = out["norm_hist"]
        position_norms = out["position_norm"].astype(np.float64)
    raw = _raw_powers(out["shift"], out["central"], n) if "central" in out else None
    powers = None  # what the accumulators' power sums take: x to x^4 (channels), x (spectrum)
    if raw is not None and ("channels" in groups or "spectrum" in groups):
        powers = raw if "channels" in groups else raw[:, :1]
    if "channels" in groups:
        peak_hists = out["peak_hist"]
        top_rows, top_peaks = out["top_rows"].tolist(), out["top_peaks"].tolist()
    if "spectrum" in groups and "product" in out:
        heavy_rows = out["heavy"].tolist()
        light_rows = n - out["heavy"].astype(np.float64)
        shift = out["center"].astype(np.float64)  # the exact float32 shift the device used
        sums = out["light_sums"].astype(np.float64)
        outer = shift[:, :, None] * sums[:, None, :]
        outer += outer.transpose(0, 2, 1)
        outer -= (light_rows[:, None] * shift)[:, :, None] * shift[:, None, :]
        gram = outer + out["product"]  # the product about the shift, plus the shift's terms
    if "quant" in groups:
        quant_token = out["quant_token"].astype(np.float64)
        quant_channel = out["quant_channel"].astype(np.float64).sum(axis=-1)
    adds: dict[str, np.ndarray] = {}  # per sum, the group's values to add ((B, ...), in order)
    if "norms" in groups:
        adds.update(norm_hist=norm_hists, unit_sum=out["unit"], position_norm=position_norms)
    if "channels" in groups:
        adds["peak_hist"] = peak_hists
    if "quant" in groups:
        adds.update(quant_token=quant_token, quant_channel=quant_channel)
    shared = _shared_stack(entries)
    if shared is not None:  # one call per sum for the whole group (the same values)
        arrays, rows = shared
        for name, values in adds.items():
            arrays[name][rows] += values
        if powers is not None:
            arrays["power"][rows, : powers.shape[1]] += powers
        if "channels" in groups:
            arrays["absmax"][rows] = np.maximum(arrays["absmax"][rows], out["absmax"])
    else:
        for b, (acc, _, _) in enumerate(entries):
            for name, values in adds.items():
                total = getattr(acc, name)
                total += values[b]
            if powers is not None:
                acc.power[: powers.shape[1]] += powers[b]
            if "channels" in groups:
                np.maximum(acc.absmax, out["absmax"][b], out=acc.absmax)
    for b, (acc, x, p) in enumerate(entries):
        acc.count += n
        acc.norm_sq_sum += square_sums[b]
        if "norms" in groups:
            acc.norm_sum += norm_sums[b]
            acc.norm_min = min(acc.norm_min, norm_mins[b])
            acc.norm_max = max(acc.norm_max, norm_maxs[b])
            if p[0] == 0:
                acc.first_norm_sum += norm_firsts[b]
                acc.first_count += 1
            acc.position_count += _piece_bin_counts(p)
        if "channels" in groups:
            acc.top = sorted(acc.top + _top_found(top_rows[b], top_peaks[b], p), reverse=True)[
                : catalogue.TOP_K
            ]
        if raw is not None and "rope" in groups and acc.band is not None and acc.rope is not None:
            first, second = acc.rope.pair_indices()
            acc.band += raw[b, 1][first] + raw[b, 1][second]
        if "spectrum" in acc.groups:
            if "product" not in out:  # a small piece: float64 on the host, as the CPU path does
                x64 = float32_rows(x).astype(np.float64)
                acc.gram += x64.T @ x64
            else:
                if heavy_rows[b]:
                    big = float32_rows(x[out["light"][b] == 0]).astype(np.float64)
                    acc.gram += big.T @ big
                if shared is None:
                    acc.gram += gram[b]
    if shared is not None and "spectrum" in groups and "product" in out:
        arrays["gram"][rows] += gram  # after each accumulator's heavy rows, as one by one
