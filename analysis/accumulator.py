"""`HeadAccumulator`: the mergeable sums of one (sequence, layer, head, tensor) and the
statistics computed from them.

An accumulator holds sums only (moments, a Gram matrix, histograms, a top-k list), so memory is
bounded by ``head_dim^2`` per head, never by the number of tokens, and accumulators of different
chunks or files merge exactly. `add` runs the fused compiled kernel (`analysis.kernel`), the
numpy reference, or mlx (`analysis.mlx_kernel`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvformat.checksum import crc32c

from . import finite
from .catalogue import (
    ALL,
    BINS,
    LEVELS,
    POSITION_BINS,
    QUANT_BITS,
    TOP_K,
    hist_index,
    position_bins,
    quant_error,
    stat_groups,
)
from .rope import Rope

if TYPE_CHECKING:
    from kvformat.reader import PayloadCheck

PIECE = 1 << 13  # rows per piece on the numpy and mlx paths (small segments are joined up to it)
KERNEL_ROWS = 1 << 12  # rows per compiled-kernel call: the piece (2 MiB of float32 at 128
# channels) is still in L2 when the Gram update reads it again (7-10% faster than 8192 rows)
_NO_PAIRS = np.empty(0, np.int64)
_NO_BAND = np.empty(0)
_GRAM_ROWS = 2048  # rows per float32 product: its rounding grows with them (see `_add_gram`)
GRAM_FLOAT64_ROWS = 512  # fewer rows than this: the Gram update in float64
HEAVY = 16.0  # squared norm over the piece's median: a row the Gram adds in float64


def _kernel() -> ModuleType:
    """`analysis.kernel`, imported on first use: numba takes ~0.2-0.4 s to import, and a process
    that only merges accumulators or builds tables from them (the parent of a pass on worker
    processes) never needs it."""
    from . import kernel

    return kernel


_BUFFERS = threading.local()  # per thread: reused float32 work buffers (fresh memory costs page faults)


def _buffer(name: str, rows: int, dim: int) -> np.ndarray:
    """This thread's ``(rows, dim)`` float32 work buffer ``name`` (grown as needed, then reused).
    A view of it is only valid until the next call for ``name`` on the same thread."""
    found = getattr(_BUFFERS, "by_key", None)
    if found is None:
        found = _BUFFERS.by_key = {}
    buffer = found.get((name, dim))
    if buffer is None or buffer.shape[0] < rows:
        buffer = found[(name, dim)] = np.empty((rows, dim), np.float32)
    return buffer[:rows]


def bytes_of(rows: np.ndarray) -> memoryview:
    """The bytes of ``rows`` (C-contiguous: a chunk's payload or rows of it), for a CRC."""
    return np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data


def float32_rows(rows: np.ndarray, reuse: bool = False) -> np.ndarray:
    """``rows`` ``(n, dim)`` as a C-contiguous float32 array: a view for float32, else one
    conversion (bfloat16 by shifting its bits into the high half of a float32); with ``reuse``,
    into this thread's work buffer (valid until its next ``reuse`` call)."""
    if rows.dtype == np.float32:
        return np.ascontiguousarray(rows)
    reused = reuse and rows.ndim == 2
    out = _buffer("rows", rows.shape[0], rows.shape[1]) if reused else np.empty(rows.shape, np.float32)
    if rows.dtype.name == "bfloat16":
        np.left_shift(rows.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, rows, casting="same_kind")
    return out


STACKED = (
    "norm_hist", "peak_hist", "power", "absmax", "gram", "unit_sum", "position_norm",
    "quant_token", "quant_channel",
)  # fmt: skip
"""The array sums `stack` lays out in one array each, across accumulators."""


@dataclass(eq=False)
class Stack:
    """The array sums (`STACKED`) of several accumulators of one dim and selection of groups,
    one array per sum with the accumulators along its first axis: accumulator ``i``'s sum is a
    view of row ``i`` (its ``_slot``)."""

    arrays: dict[str, np.ndarray]


def stack(accumulators: Sequence[HeadAccumulator]) -> Stack | None:
    """Lay out the array sums of ``accumulators`` (one dim, one selection of groups) in one array
    per sum, each accumulator's sums becoming views of its row, their values unchanged: the mlx
    fold then adds a device batch's results into many accumulators with one numpy call per sum
    instead of one per accumulator (`mlx_kernel._fold_group`: each such call of more than a few
    hundred values drops and retakes the interpreter's lock, which the thread driving the device
    holds most of the time). None, and nothing changed, for fewer than two. Whatever rebinds a
    sum afterwards (`HeadAccumulator.merge` does) takes that accumulator out of the layout: the
    fold checks and adds to it alone."""
    if len(accumulators) < 2 or len({(acc.dim, acc.groups) for acc in accumulators}) > 1:
        return None
    shared = Stack({name: np.stack([getattr(acc, name) for acc in accumulators]) for name in STACKED})
    for slot, acc in enumerate(accumulators):
        for name in STACKED:
            setattr(acc, name, shared.arrays[name][slot])
        acc._stack, acc._slot = shared, slot
    return shared


_SUMS = (
    "rope", "norm_hist", "peak_hist", "power", "absmax", "gram", "unit_sum", "band",
    "position_count", "position_norm", "top", "quant_token", "quant_channel", "_flag_array",
)  # fmt: skip
"""What `HeadAccumulator.seal` leaves out of the pickled state: what only `add` and `merge` use."""


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
    norm_hist: np.ndarray = field(default_factory=lambda: np.zeros(BINS, np.int64))
    peak_hist: np.ndarray = field(default_factory=lambda: np.zeros(BINS, np.int64))
    power: np.ndarray = field(init=False)  # (4, dim) sums of x, x^2, x^3, x^4
    absmax: np.ndarray = field(init=False)
    gram: np.ndarray = field(init=False)  # (dim, dim) sum of x x^T; (0, 0) without "spectrum"
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
    nonfinite_rows: int = 0  # rows left out of every sum: they held inf or NaN (`analysis.finite`)
    nonfinite_values: int = 0  # the inf and NaN values in those rows
    _pending: Any = field(default=None, init=False, repr=False, compare=False)  # mlx: a piece in flight
    _row: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    _flag_array: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _sealed: bool = field(default=False, init=False, repr=False, compare=False)
    _stack: Stack | None = field(default=None, init=False, repr=False, compare=False)  # see `stack`
    _slot: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.groups = stat_groups(self.groups)
        self.power = np.zeros((4, self.dim))
        self.absmax = np.zeros(self.dim)
        # 128 KiB at 128 channels: allocated only where the spectrum needs it.
        side = self.dim if "spectrum" in self.groups else 0
        self.gram = np.zeros((side, side))
        self.unit_sum = np.zeros(self.dim)
        self.band = np.zeros(self.rope.dims // 2) if self.rope is not None else None

    def add(self, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None) -> None:
        """Add ``rows`` ``(n_tokens, dim)`` at absolute ``positions`` ``(n_tokens,)``: the fused
        compiled kernel (`analysis.kernel`) where numba is installed, else numpy; with
        ``backend="mlx"``, mlx on its default device (`analysis.mlx_kernel`).

        ``check``: the CRC ``rows`` (a chunk's whole payload, read unchecked:
        `kvformat.Snapshot.read_unchecked`) must have. The compiled path checksums each piece
        just before the kernel reads it, so the kernel finds it in cache instead of reading it
        from memory a second time; a mismatch raises `kvformat.ChecksumError` once the rows are
        added, and the accumulator then holds them: it is to be dropped, as the pass does.

        Rows holding an inf or NaN are left out and counted (`drop_nonfinite`)."""
        self._check_open()
        self._row = None
        if check is not None and (self.backend == "mlx" or not _kernel().AVAILABLE):
            check.check(crc32c(bytes_of(rows)))
            check = None
        if self.backend == "mlx" or not _kernel().AVAILABLE:
            rows, positions = self.drop_nonfinite(rows, positions)
        if self.backend == "mlx":
            from . import mlx_kernel

            mlx_kernel.add(self, rows, positions)
        elif _kernel().AVAILABLE:
            # Rows whose CRC is still pending: a damaged chunk stops the pass with its
            # ChecksumError alone, not with numpy's warnings about the garbage it held.
            quiet = np.errstate(invalid="ignore", over="ignore", divide="ignore")
            with quiet if check is not None else contextlib.nullcontext():
                self._add_compiled(rows, positions, check)
        else:
            self._add_numpy(rows, positions)

    def drop_nonfinite(self, rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``rows`` ``(n, dim)`` and ``positions`` without the rows that hold inf or NaN, counted
        in `nonfinite_rows` / `nonfinite_values` (the same arrays when there are none)."""
        kept, kept_positions, bad_rows, bad_values = finite.split(rows, positions)
        self.nonfinite_rows += bad_rows
        self.nonfinite_values += bad_values
        return kept, kept_positions

    def _flags(self) -> np.ndarray:
        if self._flag_array is not None:
            return self._flag_array
        kernel = _kernel()
        flags = self._flag_array = np.zeros(kernel.FLAGS, np.int64)
        flags[kernel.NORMS] = "norms" in self.groups
        flags[kernel.CHANNELS] = "channels" in self.groups
        flags[kernel.ROPE] = "rope" in self.groups and self.band is not None
        flags[kernel.MEAN] = "channels" in self.groups or "spectrum" in self.groups
        flags[kernel.QUANT] = "quant" in self.groups
        return flags

    def _add_compiled(
        self, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None
    ) -> None:
        # Few Python-level calls per piece: with many threads, what holds the GIL sets the pace.
        kernel = _kernel()
        if self.band is not None and self.rope is not None:
            first, second = self.rope.pair_indices()
            band = self.band
        else:
            first = second = _NO_PAIRS
            band = _NO_BAND
        flags = self._flags()
        channels, spectrum = "channels" in self.groups, "spectrum" in self.groups
        scalars = np.zeros(kernel.SCALARS)
        scalars[kernel.NORM_MIN], scalars[kernel.NORM_MAX] = self.norm_min, self.norm_max
        absmax_bits = np.zeros(self.dim, np.int32)
        sums = np.zeros(self.dim)
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        crc = 0
        for start in range(0, rows.shape[0], KERNEL_ROWS):
            if check is not None:
                crc = crc32c(bytes_of(rows[start : start + KERNEL_ROWS]), crc)
            x = float32_rows(rows[start : start + KERNEL_ROWS], reuse=True)
            pos = positions[start : start + x.shape[0]]
            if finite.any_nonfinite(x):  # cache-hot: the kernel reads the piece next
                x, pos = self.drop_nonfinite(x, pos)
                x = np.ascontiguousarray(x)
            n = x.shape[0]
            if not n:
                continue
            peak_bits = np.empty(n, np.int32)
            square_norms = np.empty(n)
            sums[:] = 0.0
            kernel.accumulate(
                x=x,
                bits=x.view(np.int32),
                positions=pos,
                first=first,
                second=second,
                levels=LEVELS,
                flags=flags,
                scalars=scalars,
                norm_hist=self.norm_hist,
                peak_hist=self.peak_hist,
                sums=sums,
                power=self.power,
                absmax_bits=absmax_bits,
                unit_sum=self.unit_sum,
                band=band,
                position_count=self.position_count,
                position_norm=self.position_norm,
                peak_bits=peak_bits,
                square_norms=square_norms,
                quant_token=self.quant_token,
                quant_channel=self.quant_channel,
                edges=kernel.hist_edges(),
                guesses=kernel.hist_guesses(),
            )
            if spectrum:
                self._add_gram(x, sums, square_norms)
            self.count += n
            if channels:
                best = kernel.top_rows(peak_bits, TOP_K).tolist()
                peaks = peak_bits.view(np.float32)
                self.top = sorted(self.top + [(float(peaks[i]), int(pos[i])) for i in best], reverse=True)[
                    :TOP_K
                ]
        if channels:
            self.absmax = np.maximum(self.absmax, absmax_bits.view(np.float32))
        self.norm_sum += float(scalars[kernel.NORM_SUM])
        self.norm_sq_sum += float(scalars[kernel.SQUARE_SUM])
        self.norm_min, self.norm_max = float(scalars[kernel.NORM_MIN]), float(scalars[kernel.NORM_MAX])
        self.first_norm_sum += float(scalars[kernel.FIRST_NORM_SUM])
        self.first_count += int(scalars[kernel.FIRST_COUNT])
        if check is not None:
            check.check(crc)

    def _add_gram(self, x: np.ndarray, sums: np.ndarray, square_norms: np.ndarray) -> None:
        """Add ``x`` ``(n, dim)`` float32 (channel sums ``sums`` float64, row norms squared
        ``square_norms``) to the Gram matrix.

        Pieces under `GRAM_FLOAT64_ROWS` rows are added in float64. In larger ones, rows over
        `HEAVY` times the piece's median squared norm (massive activations, attention
        sinks) are added in float64: in float32 they would set the rounding of every entry. The
        others run in float32 (BLAS) less their mean ``c``, so rounding is relative to their
        spread, in pieces of `_GRAM_ROWS` added in float64:
        ``sum x x^T = sum (x-c)(x-c)^T + c s^T + s c^T - n c c^T`` with ``s = sum x``."""
        if x.shape[0] < GRAM_FLOAT64_ROWS:  # small pieces: float64 costs nothing there
            x64 = x.astype(np.float64)
            self.gram += x64.T @ x64
            return
        kernel = _kernel()
        heavy = kernel.heavy_rows(square_norms, HEAVY)
        n = x.shape[0]
        any_heavy = bool(heavy.any())
        if any_heavy:
            big = x[heavy].astype(np.float64)
            self.gram += big.T @ big
            sums = sums - big.sum(axis=0)
            n -= big.shape[0]
        if not n:
            return
        center = (sums / n).astype(np.float32)  # the shift; exact shifts are not needed
        # Per _GRAM_ROWS-row piece: the shift into this thread's buffer (heavy rows zeroed:
        # they were added above), then ``piece.T @ piece``, which numpy computes with BLAS's
        # symmetric rank-k update (syrk: half the multiplications of a general product). Large
        # numpy calls release the GIL; the buffer stays in cache and costs no page faults.
        for start in range(0, x.shape[0], _GRAM_ROWS):
            rows = x[start : start + _GRAM_ROWS]
            piece = _buffer("gram", rows.shape[0], rows.shape[1])
            np.subtract(rows, center, out=piece)
            if any_heavy:
                piece[heavy[start : start + _GRAM_ROWS]] = 0.0
            self.gram += piece.T @ piece
        kernel.add_shift_terms(self.gram, center, sums, n)

    def _add_numpy(self, rows: np.ndarray, positions: np.ndarray) -> None:
        for start in range(0, rows.shape[0], PIECE):
            x = np.asarray(rows[start : start + PIECE], dtype=np.float64)
            pos = positions[start : start + PIECE]
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
            self.norm_hist += np.bincount(hist_index(norms), minlength=BINS)
            magnitude = np.abs(x)
            peaks = magnitude.max(axis=1)
            self.peak_hist += np.bincount(hist_index(peaks), minlength=BINS)
            self.absmax = np.maximum(self.absmax, magnitude.max(axis=0))
            del magnitude
            self.power[0] += x.sum(0)
            self.power[1] += x2.sum(0)
            self.power[2] += np.einsum("ij,ij->j", x2, x)
            self.power[3] += np.einsum("ij,ij->j", x2, x2)
            del x2
            if "spectrum" in self.groups:
                self.gram += x.T @ x
            self.unit_sum += (1.0 / np.maximum(norms, 1e-30)) @ x
            if self.band is not None and self.rope is not None:
                self.band += self.rope.pair_energy(x)
            if pos.size and pos[0] == 0:
                self.first_norm_sum += float(norms[0])
                self.first_count += 1
            bins = position_bins(np.asarray(pos))
            self.position_count += np.bincount(bins, minlength=POSITION_BINS)
            self.position_norm += np.bincount(bins, weights=norms, minlength=POSITION_BINS)
            best = np.lexsort((np.asarray(pos), peaks))[-TOP_K:]  # among equal peaks, the later positions
            self.top = sorted(self.top + [(float(peaks[i]), int(pos[i])) for i in best], reverse=True)[:TOP_K]
            x32 = np.asarray(rows[start : start + PIECE], dtype=np.float32)
            for i, bits in enumerate(QUANT_BITS):
                self.quant_token[i] += quant_error(x32, bits, axis=1)
                self.quant_channel[i] += quant_error(x32, bits, axis=0)

    def settle(self) -> None:
        """Fold in device work still in flight (``backend="mlx"``; a no-op otherwise)."""
        if self._pending is not None:
            from . import mlx_kernel

            mlx_kernel.settle(self)

    def __getstate__(self) -> dict[str, Any]:
        self.settle()  # device arrays do not cross processes; their sums do
        state = dict(self.__dict__)
        state["_stack"] = None  # its own sums cross (as copies of its rows); the others' stay
        if self._sealed:  # the row alone crosses
            state.update(dict.fromkeys(_SUMS))
        return state

    def seal(self) -> None:
        """Compute the row and seal the accumulator: pickled, it carries the row without its sums
        (at 128 channels ~6 KB instead of ~180 KB, most of it the Gram matrix and the histograms:
        what a pass that wants the rows alone sends from its worker processes), and it refuses
        `add` and `merge`."""
        self.row_arrays()
        self._sealed = True

    def _check_open(self) -> None:
        if self._sealed:
            raise RuntimeError("this accumulator is sealed (its row computed, its sums dropped)")

    def merge(self, other: HeadAccumulator) -> None:
        """Add another accumulator of the same (layer, head, tensor) into this one (another chunk,
        sequence or file); raises ValueError when the channel counts or the groups differ."""
        self._check_open()
        other._check_open()
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
        self.nonfinite_rows += other.nonfinite_rows
        self.nonfinite_values += other.nonfinite_values
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
        for each formula); columns of groups not computed are absent; vector columns are lists.
        Computed once until the next `add` or `merge` (a pass computes it on its worker
        threads)."""
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in self.row_arrays().items()}

    def row_arrays(self) -> dict[str, Any]:
        """`row` with the vector columns as float64 numpy arrays ``(dim,)`` (``eigenvalues``,
        ``channel_*``, ``norm_by_position``, ``rope_band_energy``): what the Arrow tables are
        built from, without a Python float per value."""
        if self._row is None:
            self._row = self._statistics()
        return dict(self._row)

    def _statistics(self) -> dict[str, Any]:
        from . import rows

        self.settle()
        return rows.statistics([self])[0]
