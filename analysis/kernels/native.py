"""The CPU backend's kernels compiled ahead of time: `kernels.c`, built at install time into the
shared library ``_native`` beside this module and called through ctypes (which releases the
interpreter's lock for each call, so that threads run them in parallel).

They are the one native path: the statistics pass (`kernels.kernel`), eigenvalues (`eigen`),
float16 conversion (`halves`), the attention pass (`attention`) and simulate's min-max
quantization (`quantize_levels`). Where the library is
not built (no C compiler at install) the numpy reference computes the same table, slower, and
`missing_note` says so once. The numpy reference is the oracle the C kernels are held to
(`tests/analysis/kernels/test_kernel.py`, `tests/analysis/kernels/test_native.py`,
`tests/analysis/attention/test_head_importance.py`).

``KVSNAP_KERNEL`` in the environment: ``compiled`` (the default) takes this library where it was
built; ``numpy`` skips it. `accumulate` takes three structs (`Piece`, `Settings`,
`RunningSums`: the layouts of ``kernels.c``), the last two made once per accumulator's rows, and
adds `KERNEL_ROWS` rows a call.
"""

from __future__ import annotations

import ctypes
import os
import warnings
import zlib
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

import numpy as np

from ..stats.catalogue import QUANT_GROUP, SUMS, size_of

_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_ROPE = 2  # `kernels.kernel.ROPE`: the flag under which the kernel writes ``band``
_ROW_FIELDS = 9  # `attention.ROW_FIELDS`
QL_CHAINS = 4  # `kernels.c`: tridiagonals whose QL iterations `eigenvalues_batch` interleaves


class Piece(ctypes.Structure):
    """One `accumulate` call's rows and what it writes for each (``Piece`` in `kernels.c`)."""

    _fields_ = [
        ("x", _POINTER),  # (n, dim) float32, also read as its int32 bits
        ("n", _INT),
        ("dim", _INT),
        ("positions", _POINTER),  # (n,) int64
        ("peak_bits", _POINTER),  # (n,) int32 out: each row's max |x| as float32 bits
        ("square_norms", _POINTER),  # (n,) float64 out: each row's ||x||^2
        ("channel_sums", _POINTER),  # (dim,) float64 out: the piece's channel sums
    ]


class Settings(ctypes.Structure):
    """What stays fixed over an accumulator's pieces (``Settings`` in `kernels.c`); made by
    `settings`, which keeps the arrays it points to alive."""

    _fields_ = [
        ("first", _POINTER),  # (pairs,) int64: each RoPE pair's first channel
        ("second", _POINTER),  # (pairs,) int64: its second
        ("pairs", _INT),
        ("levels", _POINTER),  # (3,) int64: quantization levels at 8, 4, 2 bits
        ("flags", _POINTER),  # (5,) int64: `kernels.kernel.NORMS` ... ``QUANT``
        ("edges", _POINTER),  # (bins + 1,) float64: `kernels.kernel.hist_edges()`
        ("bins", _INT),
        ("guesses", _POINTER),  # (cells,) int64: `kernels.kernel.hist_guesses()`
        ("cells", _INT),
        ("group", _INT),  # `QUANT_GROUP`
    ]
    _arrays: tuple[np.ndarray, ...]
    band_size: int  # the ``band`` sums the kernel writes (0 without the ROPE flag)


_DECLARED = {total.name: total for total in SUMS}
KERNEL_SUMS = tuple(
    _DECLARED[name]
    for name in ("norm_hist", "peak_hist", "power", "unit_sum", "band", "position_count",
                 "position_norm", "quant_token", "quant_channel")
)  # fmt: skip
"""The catalogue's sums (`catalogue.SUMS`) the kernel adds into in place, in the order of the
struct's fields: each a field of its name, pointing at the accumulator's array of that sum (its
declared dtype and shape; tests hold ``kernels.c``'s field types to the declaration). The
others: ``count`` and the top peaks are added here from the call's outputs, the scalar sums and
``absmax`` go through the call's ``scalars`` and ``absmax_bits``, and ``gram`` is BLAS's."""


class RunningSums(ctypes.Structure):
    """One accumulator's running sums, which an `accumulate` call adds into (``RunningSums`` in
    `kernels.c`; `analysis.stats.sums.RunningSums` declares them): ``dim`` and
    ``position_bins``, the call's ``scalars`` (6 float64: `kernels.kernel.SCALARS`) and
    ``absmax_bits`` (``(dim,)`` int32: each channel's max |x| as float32 bits), then a pointer
    for each of `KERNEL_SUMS`. Made by `running_sums`, which keeps the arrays it points to
    alive."""

    _fields_ = [
        ("dim", _INT),
        ("position_bins", _INT),
        ("scalars", _POINTER),
        ("absmax_bits", _POINTER),
        *((total.name, _POINTER) for total in KERNEL_SUMS),
    ]
    _arrays: tuple[np.ndarray, ...]


def _load(here: Path = Path(__file__).parent) -> ctypes.CDLL | None:
    """The library built in ``here`` (beside this module), or None: not built (no C compiler at
    install, or a source tree never installed), not a build of this version (an older build
    without a function this module calls, or built from another ``kernels.c`` than the one
    beside it: a source tree edited or checked out since, compared by CRC-32, which file times
    copied or unpacked in any order cannot fool; a warning says so), or ``KVSNAP_KERNEL`` asks
    for another path."""
    if os.environ.get("KVSNAP_KERNEL", "compiled") != "compiled":
        return None

    for suffix in EXTENSION_SUFFIXES:
        path = here / f"_native{suffix}"
        if path.is_file():
            try:
                library = ctypes.CDLL(str(path))
            except OSError:  # built for another machine: the numpy reference then
                return None
            try:
                current = _built_from(library, here / "kernels.c")
                _declare(library)
            except AttributeError:  # an older build, without a function this module calls
                current = False
            if not current:
                warnings.warn(
                    f"{path} is not a build of this kvsnap's kernels.c (an older build, or the source "
                    "changed since): the numpy reference runs until it is rebuilt (pip install -e .)",
                    stacklevel=2,
                )
                return None
            return library
    return None


def _built_from(library: ctypes.CDLL, source: Path) -> bool:
    """Whether ``library`` was built from ``source`` as it is now (True where there is none to
    compare: an install without the source beside it)."""

    if not source.is_file():
        return True
    library.kvsnap_source_crc.restype = ctypes.c_char_p
    recorded = library.kvsnap_source_crc().decode()
    return recorded == f"{zlib.crc32(source.read_bytes()):08x}"


def _declare(library: ctypes.CDLL) -> None:
    """Argument and result types of the library's functions (`kernels.c`)."""
    library.kvsnap_accumulate.argtypes = [
        ctypes.POINTER(Piece),
        ctypes.POINTER(Settings),
        ctypes.POINTER(RunningSums),
    ]
    library.kvsnap_accumulate.restype = ctypes.c_int
    library.kvsnap_top_rows.argtypes = [_POINTER, _INT, _INT, _POINTER]
    library.kvsnap_top_rows.restype = _INT
    library.kvsnap_add_shift_terms.argtypes = [_POINTER, _INT, _POINTER, _POINTER, _INT]
    library.kvsnap_add_shift_terms.restype = None
    library.kvsnap_halves_to_float32.argtypes = [_POINTER, _INT, _POINTER]
    library.kvsnap_halves_to_float32.restype = None
    library.kvsnap_eigenvalues_batch.argtypes = [_POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _POINTER]
    library.kvsnap_eigenvalues_batch.restype = None
    double = ctypes.c_double
    library.kvsnap_block_scores.argtypes = [
        _POINTER,
        _INT,
        _INT,
        _POINTER,
        _POINTER,
        _POINTER,
        double,
        double,
    ]
    library.kvsnap_block_scores.argtypes += [_INT, _INT, double, ctypes.c_int, _INT, _INT, _INT]
    library.kvsnap_block_scores.restype = ctypes.c_int
    library.kvsnap_exp_nonpositive.argtypes = [_POINTER, _INT, _POINTER]
    library.kvsnap_exp_nonpositive.restype = None
    library.kvsnap_quantize_levels.argtypes = [_POINTER, _INT, _INT, _INT, ctypes.c_float]
    library.kvsnap_quantize_levels.argtypes += [_POINTER, _POINTER, _POINTER]
    library.kvsnap_quantize_levels.restype = ctypes.c_int
    library.kvsnap_lagkv_spread.argtypes = [_POINTER, _INT, _INT, _INT, _POINTER, _POINTER]
    library.kvsnap_lagkv_spread.restype = ctypes.c_int


LIBRARY = _load()
AVAILABLE = LIBRARY is not None


REQUESTED = os.environ.get("KVSNAP_KERNEL", "compiled") == "compiled"


def missing_note() -> str | None:
    """One line for the user where the compiled kernels were wanted but are not built (no C
    compiler when kvsnap was installed): what runs instead and how to get them. None where they
    are loaded, or ``KVSNAP_KERNEL=numpy`` asked for the reference."""
    if AVAILABLE or not REQUESTED:
        return None
    return (
        "kvsnap's compiled kernels are not built (no C compiler at install): the numpy reference "
        "computes the same table, slower. Install a C compiler (gcc or clang) and reinstall kvsnap "
        "(pip install --force-reinstall --no-deps kvsnap, or pip install -e . in a checkout)."
    )


def _address(array: np.ndarray, dtype: type | np.dtype[Any], size: int | None = None) -> int:
    """The address of C-contiguous ``array`` of ``dtype`` (of at least ``size`` elements): what
    the C code may read and write. Anything else is a caller's bug, raised before C sees it."""
    if array.dtype != dtype or not array.flags.c_contiguous or (size is not None and array.size < size):
        # internal: a caller in kvsnap broke the contract (a bug)
        raise TypeError(f"native kernel: expected a C-contiguous {np.dtype(dtype)} array of >= {size}")
    return int(array.__array_interface__["data"][0])


def settings(
    first: np.ndarray,
    second: np.ndarray,
    levels: np.ndarray,
    flags: np.ndarray,
    edges: np.ndarray,
    guesses: np.ndarray,
) -> Settings:
    """The `Settings` of an accumulator's `accumulate` calls: RoPE pairs ``first``, ``second``
    ``(pairs,)`` int64 (empty without a band), quantization ``levels`` ``(3,)``, the groups'
    ``flags`` ``(5,)`` (`kernels.kernel.NORMS` ...), histogram ``edges`` ``(bins + 1,)`` and
    ``guesses`` (`kernels.kernel.hist_edges()`, ``hist_guesses()``)."""
    first, second = np.ascontiguousarray(first), np.ascontiguousarray(second)  # (strided pairings)
    pairs = first.shape[0]
    bins = edges.shape[0] - 1
    made = Settings(
        first=_address(first, np.int64),
        second=_address(second, np.int64, pairs),
        pairs=pairs,
        levels=_address(levels, np.int64, 3),
        flags=_address(flags, np.int64, 5),
        edges=_address(edges, np.float64, bins + 1),
        bins=bins,
        guesses=_address(guesses, np.int64),
        cells=guesses.shape[0],
        group=QUANT_GROUP,
    )
    made._arrays = (first, second, levels, flags, edges, guesses)  # alive while it is
    made.band_size = pairs if flags[_ROPE] else 0
    return made


_EMPTY = np.empty(0)


def running_sums(acc: Any, settings: Settings, scalars: np.ndarray, absmax_bits: np.ndarray) -> RunningSums:
    """The `RunningSums` struct over accumulator ``acc``'s arrays (`analysis.stats.sums.RunningSums`:
    the struct's fields are its sums by name; ``band`` empty where it keeps none) and the call's
    ``scalars`` (`kernels.kernel.SCALARS`,: sum ||x||, sum ||x||^2, min ||x||, max ||x||, sum
    ||x_0||, count of x_0) and ``absmax_bits`` ``(dim,)`` int32 (the float32 bits of each
    channel's max |x| so far), each checked against the sizes ``settings`` implies. The arrays
    stay alive as long as the struct."""
    arrays = {total.name: getattr(acc, total.name) for total in KERNEL_SUMS}
    if arrays["band"] is None:
        arrays["band"] = _EMPTY
    pointers = {
        total.name: _address(
            arrays[total.name], np.dtype(total.dtype), size_of(total, acc.dim, settings.band_size)
        )
        for total in KERNEL_SUMS
    }
    made = RunningSums(
        dim=acc.dim,
        position_bins=acc.position_count.shape[0],
        scalars=_address(scalars, np.float64, 6),
        absmax_bits=_address(absmax_bits, np.int32, acc.dim),
        **pointers,
    )
    made._arrays = (scalars, absmax_bits, *arrays.values())
    return made


def accumulate(
    x: np.ndarray,
    positions: np.ndarray,
    peak_bits: np.ndarray,
    square_norms: np.ndarray,
    channel_sums: np.ndarray,
    settings: Settings,
    sums: RunningSums,
) -> None:
    """Add ``x`` ``(n_tokens, dim)`` float32 at ``positions`` ``(n_tokens,)`` to ``sums``, for
    the groups ``settings`` selects, one tile of ``QUANT_GROUP`` rows at a time (the row pass,
    then the quantization pass on the same tile). Per row and piece it writes ``peak_bits``
    ``(n_tokens,)`` int32 (each row's max |x| as float32 bits, counted in ``peak_hist`` too),
    ``square_norms`` ``(n_tokens,)`` float64 (each row's ||x||^2) and ``channel_sums`` ``(dim,)``
    float64 (the piece's channel sums, also added to ``power[0]``; zeroed by the caller)."""
    assert LIBRARY is not None
    n, dim = x.shape
    positions = np.ascontiguousarray(positions)
    piece = Piece(
        x=_address(x, np.float32),
        n=n,
        dim=dim,
        positions=_address(positions, np.int64, n),
        peak_bits=_address(peak_bits, np.int32, n),
        square_norms=_address(square_norms, np.float64, n),
        channel_sums=_address(channel_sums, np.float64, dim),
    )
    status = LIBRARY.kvsnap_accumulate(ctypes.byref(piece), ctypes.byref(settings), ctypes.byref(sums))
    if status == -2:
        # internal: a caller in kvsnap broke the contract (a bug)
        raise TypeError(f"native kernel: {dim}-channel rows for {sums.dim}-channel sums")
    if status:
        raise MemoryError("native kernel: no memory for its work space")


def top_rows(peak_bits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``min(k, n)`` rows with the largest peaks, unordered (``peak_bits``
    ``(n,)``: non-negative float32 bits as int32, which order as the floats do); among equal
    peaks the later rows, as the catalogue's (value, position) order ranks them."""
    assert LIBRARY is not None
    best = np.empty(max(0, min(k, peak_bits.shape[0])), np.int64)
    LIBRARY.kvsnap_top_rows(_address(peak_bits, np.int32), peak_bits.shape[0], k, _address(best, np.int64))
    return best


def add_shift_terms(gram: np.ndarray, center: np.ndarray, sums: np.ndarray, n: int) -> None:
    """``gram += c s^T + s c^T - n c c^T`` (``gram`` ``(dim, dim)`` float64 in place; ``c`` =
    ``center``): what turns the Gram matrix of rows less ``c`` into that of the rows, ``s`` their
    sum."""
    assert LIBRARY is not None
    dim = gram.shape[0]
    LIBRARY.kvsnap_add_shift_terms(
        _address(gram, np.float64, dim * dim),
        dim,
        _address(center, np.float32, dim),
        _address(sums, np.float64, dim),
        n,
    )


def halves_to_float32(halves: np.ndarray, out: np.ndarray) -> None:
    """`halves.to_float32`'s conversion, in C: uint16 float16 bits ``halves`` into float32
    ``out`` of the same size (both C-contiguous)."""
    assert LIBRARY is not None
    if out.size != halves.size:
        # internal: a caller in kvsnap broke the contract (a bug)
        raise TypeError("native kernel: out must have as many values as halves")
    LIBRARY.kvsnap_halves_to_float32(_address(halves, np.uint16), halves.size, _address(out, np.float32))


def eigenvalues(matrix: np.ndarray, out: np.ndarray, a: np.ndarray, e: np.ndarray) -> bool:
    """`eigenvalues_batch` of one matrix: symmetric ``matrix`` ``(n, n)`` float64's eigenvalues
    into ``out`` ``(n,)``, unordered; ``a`` and ``e`` are not used. False when the iteration did
    not converge (the caller asks LAPACK then)."""
    values, converged = eigenvalues_batch(np.ascontiguousarray(matrix, np.float64)[None])
    out[:] = values[0]
    return bool(converged[0])


def eigenvalues_batch(matrices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`eigenvalues` of each symmetric matrix of ``matrices`` ``(b, n, n)`` float64, `QL_CHAINS` at
    a time (their QL iterations interleaved, each matrix's values bit for bit as alone): ``(b, n)``
    unordered, and ``(b,)`` bool, False where one did not converge."""
    assert LIBRARY is not None
    count, n = matrices.shape[0], matrices.shape[-1]
    out = np.empty((count, n))
    converged = np.empty(count, np.int32)
    work, e = np.empty((n, n)), np.empty((QL_CHAINS + 2, n))
    LIBRARY.kvsnap_eigenvalues_batch(
        _address(matrices, np.float64, count * n * n),
        count,
        n,
        _address(out, np.float64),
        _address(work, np.float64),
        _address(e, np.float64),
        _address(converged, np.int32),
    )
    return out, converged.astype(bool)


def block_scores(
    logits: np.ndarray,
    rows: np.ndarray,
    query_positions: np.ndarray,
    key_positions: np.ndarray,
    scale: float,
    softcap: float,
    window: int,
    keep: int,
    sink: float,
    has_sink: bool,
    sinks: int,
    local: int,
    stream_window: int,
) -> None:
    """`attention.block_scores` (the module's docstring gives the arguments), in C: ``logits``
    ``(n, m)`` float32 overwritten, ``rows`` ``(n, attention.ROW_FIELDS)`` float64."""
    assert LIBRARY is not None
    n, m = logits.shape
    if query_positions.shape != (n,) or key_positions.shape != (m,):
        # internal: a caller in kvsnap broke the contract (a bug)
        raise TypeError("native kernel: one query position per row, one key position per column")
    status = LIBRARY.kvsnap_block_scores(
        _address(logits, np.float32),
        n,
        m,
        _address(rows, np.float64, n * _ROW_FIELDS),
        _address(query_positions, np.int64),
        _address(key_positions, np.int64),
        scale,
        softcap,
        window,
        keep,
        sink,
        int(has_sink),
        sinks,
        local,
        stream_window,
    )
    if status:
        raise MemoryError("native kernel: no memory for its work space")


def exp_nonpositive(d: np.ndarray) -> np.ndarray:
    """The attention pass's own float32 ``exp`` of each of ``d`` (float32, ``<= 0``; 0 below
    float32's normal range), as `block_scores` computes it: for the tests."""
    assert LIBRARY is not None
    d = np.ascontiguousarray(d, np.float32)
    out = np.empty_like(d)
    LIBRARY.kvsnap_exp_nonpositive(_address(d, np.float32), d.size, _address(out, np.float32))
    return out


def quantize_levels(x: np.ndarray, levels: int) -> np.ndarray | None:
    """``x`` ``(groups, rows, cols)`` float32 rounded to ``levels + 1`` steps between its minimum
    and maximum over ``rows`` (per group and column), bit for bit as
    `kvsnap.analysis.attention.compression`'s numpy definition; None where the library is not
    loaded or ``x`` holds a NaN or an infinity (the numpy definition then computes it)."""
    if LIBRARY is None or not REQUESTED or x.ndim != 3 or not x.size:
        return None
    x = np.ascontiguousarray(x, np.float32)
    groups, rows, cols = x.shape
    out = np.empty_like(x)
    lows, highs = np.empty(cols, np.float32), np.empty(cols, np.float32)
    status = LIBRARY.kvsnap_quantize_levels(
        _address(x, np.float32), groups, rows, cols, float(levels), _address(out, np.float32),
        _address(lows, np.float32), _address(highs, np.float32),
    )  # fmt: skip
    return None if status else out


def lagkv_spread(parts: np.ndarray) -> np.ndarray | None:
    """LagKV's spread of ``parts`` ``(count, lag, cols)`` float64: ``(count - 1, lag)``, each row
    of a part but the last scaled by the next part's per-column range, its standard deviation
    (ddof 1) over the columns, bit for bit as `kvsnap.analysis.attention.compression`'s numpy
    definition; None where the library is not loaded or ``parts`` holds a NaN or an infinity
    (the numpy definition then computes it)."""
    if LIBRARY is None or not REQUESTED or parts.ndim != 3 or parts.shape[0] < 2 or parts.shape[2] < 2:
        return None
    parts = np.ascontiguousarray(parts, np.float64)
    count, lag, cols = parts.shape
    out = np.empty((count - 1, lag))
    work = np.empty(3 * cols)
    status = LIBRARY.kvsnap_lagkv_spread(
        _address(parts, np.float64), count, lag, cols, _address(out, np.float64), _address(work, np.float64)
    )
    return None if status else out
