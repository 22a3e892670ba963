"""Row arrays as every backend takes them: piece sizes, the bytes of rows for a CRC, rows as
float32, and per-thread work buffers. No statistic is computed here."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

PIECE = 1 << 13  # rows per piece on the numpy and mlx paths (small segments are joined up to it)
KERNEL_ROWS = 1 << 12  # rows per compiled-kernel call: a piece still in L2 when the Gram update reads it
GRAM_ROWS = 2048  # rows per float32 Gram product: its rounding grows with them
GRAM_FLOAT64_ROWS = 512  # fewer rows than this: the Gram update in float64
HEAVY = 16.0  # squared norm over the piece's median: a row the Gram adds in float64

_BUFFERS = threading.local()  # per thread: reused float32 work buffers (fresh memory costs page faults)


def work_buffer(name: str, rows: int, dim: int) -> np.ndarray:
    """This thread's ``(rows, dim)`` float32 work buffer ``name`` (grown as needed, then reused).
    A view of it is only valid until the next call for ``name`` on the same thread."""
    found = getattr(_BUFFERS, "by_key", None)
    if found is None:
        found = _BUFFERS.by_key = {}
    buffer = found.get((name, dim))
    if buffer is None or buffer.shape[0] < rows:
        buffer = found[(name, dim)] = np.empty((rows, dim), np.float32)
    return buffer[:rows]


def work_matrix(name: str, rows: int, columns: int) -> np.ndarray:
    """This thread's float32 work buffer ``name`` as a C-contiguous ``(rows, columns)`` matrix:
    one flat buffer per name, grown as needed, whatever the shapes asked of it. A view of it is
    only valid until the next call for ``name`` on the same thread."""
    found = getattr(_BUFFERS, "flat", None)
    if found is None:
        found = _BUFFERS.flat = {}
    buffer = found.get(name)
    if buffer is None or buffer.size < rows * columns:
        buffer = found[name] = np.empty(rows * columns, np.float32)
    return buffer[: rows * columns].reshape(rows, columns)


def bytes_of(rows: np.ndarray) -> memoryview:
    """The bytes of ``rows`` (C-contiguous: a chunk's payload or rows of it), for a CRC."""
    return np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data


def float32_rows(
    rows: np.ndarray, reuse: bool = False, compiled: bool = False, buffer: str = "rows"
) -> np.ndarray:
    """``rows`` ``(n, dim)`` as a C-contiguous float32 array: a view for float32, else one
    conversion (bfloat16 by shifting its bits into the high half of a float32; float16 with
    ``compiled`` by `halves`, C's where it is built); with ``reuse``, into this
    thread's work buffer ``buffer`` (valid until its next ``reuse`` call for that name)."""
    if rows.dtype == np.float32:
        return np.ascontiguousarray(rows)
    reused = reuse and rows.ndim == 2
    out = work_buffer(buffer, rows.shape[0], rows.shape[1]) if reused else np.empty(rows.shape, np.float32)
    if rows.dtype.name == "bfloat16":
        np.left_shift(rows.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    elif compiled and rows.dtype == np.float16 and rows.flags.c_contiguous and (compiler := _halves()):
        compiler.to_float32(rows, out)
    else:
        np.copyto(out, rows, casting="same_kind")
    return out


def _halves() -> Any:
    """`analysis.kernels.halves` where its C build is installed, else None (imported on first
    use: the mlx backend never loads it)."""
    from . import halves

    return halves if halves.AVAILABLE else None
