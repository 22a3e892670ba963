"""The CPU backend's kernels compiled ahead of time: `kernels.c`, built at install time into the
shared library ``_native`` beside this module and called through ctypes (which releases the
interpreter's lock for each call, as numba's ``nogil`` does).

They compute what the numba functions of `backends.kernel`, `eigen`, `halves` and `attention_kernel`
compute, and stand in for them where the library was built: a process that uses them then never
imports numba, whose import and typing registries a fresh ``kvsnap stats`` and the fork server of
its workers would pay for (`python -m benchmarks.cli_bench`). The quantization errors equal numba's
bit for bit; the float64 sums agree to ~1e-15 relative (their lanes of partial sums differ);
`tests/test_native.py` holds both. The attention pass's float32 sums agree with numba's and the
numpy definition's to float32 rounding (`tests/test_head_importance.py`).

``KVSNAP_KERNEL`` in the environment: ``compiled`` (the default) takes this library where it was
built and numba otherwise; ``numba`` skips the library; ``numpy`` skips both. Each call pays
ctypes' conversion of every array argument, so `accumulate` adds `KERNEL_ROWS` rows a call.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np

from .catalogue import QUANT_GROUP

_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
_ROPE = 2  # `backends.kernel.ROPE`: the flag under which the kernel writes ``band``
_ROW_FIELDS = 9  # `attention_kernel.ROW_FIELDS`
QL_CHAINS = 4  # `kernels.c`: tridiagonals whose QL iterations `eigenvalues_batch` interleaves


def _load(here: Path = Path(__file__).parent) -> ctypes.CDLL | None:
    """The library built in ``here`` (beside this module), or None: not built (no C compiler at
    install, or a source tree never installed), not a build of this version (an older build
    without a function this module calls, or built from another ``kernels.c`` than the one
    beside it: a source tree edited or checked out since, compared by CRC-32, which file times
    copied or unpacked in any order cannot fool; a warning says so), or ``KVSNAP_KERNEL`` asks
    for another path."""
    if os.environ.get("KVSNAP_KERNEL", "compiled") != "compiled":
        return None
    from importlib.machinery import EXTENSION_SUFFIXES

    for suffix in EXTENSION_SUFFIXES:
        path = here / f"_native{suffix}"
        if path.is_file():
            try:
                library = ctypes.CDLL(str(path))
            except OSError:  # built for another machine: the numba path then
                return None
            try:
                current = _built_from(library, here / "kernels.c")
                _declare(library)
            except AttributeError:  # an older build, without a function this module calls
                current = False
            if not current:
                import warnings

                warnings.warn(
                    f"{path} is not a build of this kvsnap's kernels.c (an older build, or the source "
                    "changed since): the numba kernels run until it is rebuilt (pip install -e .)",
                    stacklevel=2,
                )
                return None
            return library
    return None


def _built_from(library: ctypes.CDLL, source: Path) -> bool:
    """Whether ``library`` was built from ``source`` as it is now (True where there is none to
    compare: an install without the source beside it)."""
    import zlib

    if not source.is_file():
        return True
    library.kvsnap_source_crc.restype = ctypes.c_char_p
    recorded = library.kvsnap_source_crc().decode()
    return recorded == f"{zlib.crc32(source.read_bytes()):08x}"


def _declare(library: ctypes.CDLL) -> None:
    """Argument and result types of the library's functions (`kernels.c`)."""
    library.kvsnap_accumulate.argtypes = [_POINTER, _INT, _INT, _POINTER, _POINTER, _POINTER, _INT]
    library.kvsnap_accumulate.argtypes += [_POINTER] * 5 + [_INT] + [_POINTER] * 7 + [_INT]
    library.kvsnap_accumulate.argtypes += [_POINTER] * 6 + [_INT, _INT]
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


LIBRARY = _load()
AVAILABLE = LIBRARY is not None


def numba_fallback() -> Any:
    """numba, for the kernels' numba twins, where this library is not loaded (not built, or
    ``KVSNAP_KERNEL`` asks for numba); else None, and numba stays unimported. None as well where
    numba is not installed."""
    if AVAILABLE:
        return None
    try:
        import numba
    except ImportError:  # pragma: no cover - exercised where numba is absent
        return None
    return numba


def _address(array: np.ndarray, dtype: type, size: int | None = None) -> int:
    """The address of C-contiguous ``array`` of ``dtype`` (of at least ``size`` elements): what
    the C code may read and write. Anything else is a caller's bug, raised before C sees it."""
    if array.dtype != dtype or not array.flags.c_contiguous or (size is not None and array.size < size):
        raise TypeError(f"native kernel: expected a C-contiguous {np.dtype(dtype)} array of >= {size}")
    return int(array.__array_interface__["data"][0])


def accumulate(
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
    """`backends.kernel.accumulate` (its docstring gives the arguments), in C. ``bits`` is
    ``x``'s int32 view, as there; the C code reads ``x``'s memory both ways."""
    assert LIBRARY is not None
    n, dim = x.shape
    if not np.shares_memory(bits, x):
        raise TypeError("native kernel: bits must be the int32 view of x")
    first, second = np.ascontiguousarray(first), np.ascontiguousarray(second)  # (strided pairings)
    positions = np.ascontiguousarray(positions)
    pairs = first.shape[0]
    bins = norm_hist.shape[0]
    status = LIBRARY.kvsnap_accumulate(
        _address(x, np.float32),
        n,
        dim,
        _address(positions, np.int64, n),
        _address(first, np.int64),
        _address(second, np.int64, pairs),
        pairs,
        _address(levels, np.int64, 3),
        _address(flags, np.int64, 5),
        _address(scalars, np.float64, 6),
        _address(norm_hist, np.int64, bins),
        _address(peak_hist, np.int64, bins),
        bins,
        _address(sums, np.float64, dim),
        _address(power, np.float64, 4 * dim),
        _address(absmax_bits, np.int32, dim),
        _address(unit_sum, np.float64, dim),
        _address(band, np.float64, pairs if flags[_ROPE] else 0),
        _address(position_count, np.int64),
        _address(position_norm, np.float64, position_count.shape[0]),
        position_count.shape[0],
        _address(peak_bits, np.int32, n),
        _address(square_norms, np.float64, n),
        _address(quant_token, np.float64, 3),
        _address(quant_channel, np.float64, 3),
        _address(edges, np.float64, bins + 1),
        _address(guesses, np.int64),
        guesses.shape[0],
        QUANT_GROUP,
    )
    if status:
        raise MemoryError("native kernel: no memory for its work space")


def top_rows(peak_bits: np.ndarray, k: int) -> np.ndarray:
    """`backends.kernel.top_rows`, in C: indices of the ``min(k, n)`` largest of ``peak_bits``."""
    assert LIBRARY is not None
    best = np.empty(max(0, min(k, peak_bits.shape[0])), np.int64)
    LIBRARY.kvsnap_top_rows(_address(peak_bits, np.int32), peak_bits.shape[0], k, _address(best, np.int64))
    return best


def add_shift_terms(gram: np.ndarray, center: np.ndarray, sums: np.ndarray, n: int) -> None:
    """`backends.kernel.add_shift_terms`, in C: ``gram`` ``(dim, dim)`` float64 in place."""
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
        raise TypeError("native kernel: out must have as many values as halves")
    LIBRARY.kvsnap_halves_to_float32(_address(halves, np.uint16), halves.size, _address(out, np.float32))


def eigenvalues(matrix: np.ndarray, out: np.ndarray, a: np.ndarray, e: np.ndarray) -> bool:
    """`eigen._eigenvalues`, in C (`eigenvalues_batch` of the one matrix): symmetric ``matrix``
    ``(n, n)`` float64's eigenvalues into ``out`` ``(n,)``, unordered; ``a`` and ``e``, numba's
    work space, are not used. False when the iteration did not converge (the caller asks LAPACK
    then)."""
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
    """`attention_kernel.block_scores` (its docstring gives the arguments), in C: ``logits``
    ``(n, m)`` float32 overwritten, ``rows`` ``(n, attention_kernel.ROW_FIELDS)`` float64."""
    assert LIBRARY is not None
    n, m = logits.shape
    if query_positions.shape != (n,) or key_positions.shape != (m,):
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
