"""Rows as float32 (`analysis.kernels.arrays.float32_rows`): the compiled float16 conversion
(`analysis.kernels.halves`) against numpy's, bit for bit."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from kvsnap.analysis.kernels import halves
from kvsnap.analysis.kernels.arrays import float32_rows


def test_every_half_converts_to_numpys_bits() -> None:
    """All 65,536 float16 bit patterns (zeros, subnormals, normals, infinities, NaNs with their
    payloads, both signs) give the float32 bits numpy's ``astype`` gives."""
    halves_all = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(256, 256)
    got = float32_rows(halves_all, compiled=True)
    expected = halves_all.astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("subnormals", [False, True], ids=["normal-only", "with-subnormals"])
def test_rows_of_halves_reused_buffer_and_no_compile(subnormals: bool) -> None:
    """Rows with and without subnormals (the second pass runs only for the latter), into the
    thread's reused buffer; the plain path (``compiled=False``) gives the same."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((300, 64)).astype(np.float16)
    rows[np.abs(rows) < 1e-3] = 1
    if subnormals:
        rows[5, 3], rows[7, 9] = np.float16(3e-6), np.float16(-6e-8)
    assert bool((np.abs(rows) < 2.0**-14).any()) is subnormals
    expected = rows.astype(np.float32)
    for compiled in (True, False):
        got = float32_rows(rows, reuse=True, compiled=compiled)
        np.testing.assert_array_equal(got, expected)


def test_other_dtypes_and_strided_rows_keep_their_paths() -> None:
    """float32 comes back as is; bfloat16 by its bit shift; float16 rows that are not C-contiguous
    take numpy's conversion."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((20, 8)).astype(np.float32)
    assert float32_rows(x, compiled=True) is x or np.shares_memory(float32_rows(x, compiled=True), x)
    b = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(float32_rows(b, compiled=True), b.astype(np.float32))
    h = x.astype(np.float16)[:, ::2]
    np.testing.assert_array_equal(float32_rows(h, compiled=True), h.astype(np.float32))
    assert halves.AVAILABLE


def test_work_matrix_grows_and_is_reused_per_thread() -> None:
    """One flat buffer per name and thread, whatever the shapes asked of it: a smaller matrix is a
    view of the same memory (no fresh pages), a larger one a new buffer; another thread's is its own."""
    from kvsnap.analysis.kernels.arrays import work_matrix

    big = work_matrix("test matrix", 4, 6)
    small = work_matrix("test matrix", 3, 5)
    assert big.shape == (4, 6) and small.shape == (3, 5) and small.flags.c_contiguous
    assert np.shares_memory(big, small)
    assert not np.shares_memory(small, work_matrix("test matrix", 5, 6))  # grown
    found: list[np.ndarray] = []
    thread = threading.Thread(target=lambda: found.append(work_matrix("test matrix", 3, 5)))
    thread.start()
    thread.join()
    assert not np.shares_memory(found[0], work_matrix("test matrix", 3, 5))
