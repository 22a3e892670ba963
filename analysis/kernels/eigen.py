"""Eigenvalues of a symmetric matrix, compiled (C, `native`; LAPACK where it is not built), so
that the heads of a file decompose in parallel: LAPACK's ``syevd`` as numpy ships it (OpenBLAS)
runs one call at a time whatever the number of threads calling it, which made the spectra of a
file with many heads a serial tail.

Householder reduction to tridiagonal form (the eigenvalue-only path of ``tred2``, Numerical
Recipes 11.2, on the full symmetric matrix so that every inner loop runs over a contiguous row),
then the root-free QL iteration with Wilkinson shifts of LAPACK's ``dsterf`` (two divisions a
rotation, no square root: 1.5x faster than ``tqli``'s implicit QL on 128 x 128 Gram matrices),
the matrix scaled by a power of two first so that no square can overflow or underflow. Both
steps are backward stable: each eigenvalue is within ~n eps ||A|| of LAPACK's
(`tests/analysis/kernels/test_kernel.py` holds them to 1e-12 of the largest).
"""

from __future__ import annotations

import numpy as np

from . import native

COMPILED = native.AVAILABLE


def _eigenvalues(matrix: np.ndarray, out: np.ndarray, a: np.ndarray, e: np.ndarray) -> bool:
    """The C solver on one symmetric ``matrix`` ``(n, n)`` float64: its eigenvalues into ``out``
    ``(n,)``, unordered; False where the iteration did not converge."""
    return native.eigenvalues(matrix, out, a, e)


def eigenvalues(matrix: np.ndarray) -> np.ndarray:
    """The eigenvalues of symmetric ``matrix`` ``(n, n)`` float64, in descending order."""
    matrix = np.ascontiguousarray(matrix, dtype=np.float64)
    return eigenvalues_of(matrix[None])[0]


def eigenvalues_of(matrices: np.ndarray) -> np.ndarray:
    """The eigenvalues of each symmetric matrix of ``matrices`` ``(b, n, n)`` float64, each row
    of the result ``(b, n)`` in descending order: the C solver four matrices at a time
    (`native.QL_CHAINS`), LAPACK where it is not built or did not converge."""
    matrices = np.ascontiguousarray(matrices, dtype=np.float64)
    count, n = matrices.shape[0], matrices.shape[-1]
    result = np.empty((count, n))
    if n == 0:
        return result
    if not COMPILED:
        result[:] = np.linalg.eigvalsh(matrices)[:, ::-1]
        return result
    values, converged = native.eigenvalues_batch(matrices)
    for failed in np.flatnonzero(~converged):
        values[failed] = np.linalg.eigvalsh(matrices[failed])
    result[:] = np.sort(values, axis=-1)[:, ::-1]
    return result
