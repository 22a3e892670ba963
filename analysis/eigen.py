"""Eigenvalues of a symmetric matrix, compiled (C where built, `native`; else numba ``nogil``), so
that the heads of a file decompose in parallel: LAPACK's ``syevd`` as numpy ships it (OpenBLAS)
runs one call at a time whatever the number of threads calling it, which made the spectra of a
file with many heads a serial tail.

Householder reduction to tridiagonal form (the eigenvalue-only path of ``tred2``, Numerical
Recipes 11.2, on the full symmetric matrix so that every inner loop runs over a contiguous row),
then the root-free QL iteration with Wilkinson shifts of LAPACK's ``dsterf`` (two divisions a
rotation, no square root: 1.5x faster than ``tqli``'s implicit QL on 128 x 128 Gram matrices),
the matrix scaled by a power of two first so that no square can overflow or underflow. Both
steps are backward stable: each eigenvalue is within ~n eps ||A|| of LAPACK's
(`tests/test_kernel.py` holds them to 1e-12 of the largest).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import native

numba: Any = native.numba_fallback()  # (KVSNAP_KERNEL=numpy keeps it: that selects the accumulator's path)

MAX_SWEEPS = 30  # QL iterations per eigenvalue (on average) before giving up, as dsterf does
EPSILON_SQUARED = (2.0**-53) ** 2  # LAPACK's eps (half a unit in the last place), squared
SMALLEST = 2.2250738585072014e-308  # the smallest normal float64 (LAPACK's safmin)


def _tridiagonalize(a: np.ndarray, d: np.ndarray, e: np.ndarray) -> None:
    """Reduce symmetric ``a`` ``(n, n)`` (overwritten) to tridiagonal: diagonal ``d``,
    sub-diagonal ``e[1:]`` (``e[0]`` = 0)."""
    n = a.shape[0]
    for i in range(n - 1, 0, -1):
        last = i - 1
        h = 0.0
        if last > 0:
            scale = 0.0
            for k in range(last + 1):
                scale += abs(a[i, k])
            if scale == 0.0:
                e[i] = a[i, last]
            else:
                for k in range(last + 1):
                    a[i, k] /= scale
                    h += a[i, k] * a[i, k]
                f = a[i, last]
                g = -np.sqrt(h) if f >= 0.0 else np.sqrt(h)
                e[i] = scale * g
                h -= f * g
                a[i, last] = f - g
                f = 0.0
                for j in range(last + 1):
                    g = 0.0
                    for k in range(last + 1):  # the full row: a[j, k] = a[k, j]
                        g += a[j, k] * a[i, k]
                    e[j] = g / h
                    f += e[j] * a[i, j]
                hh = f / (h + h)
                for j in range(last + 1):
                    e[j] -= hh * a[i, j]
                for j in range(last + 1):  # symmetric rank-2 update, full rows
                    f = a[i, j]
                    g = e[j]
                    for k in range(last + 1):
                        a[j, k] -= f * e[k] + g * a[i, k]
        else:
            e[i] = a[i, last]
        d[i] = h
    e[0] = 0.0
    for i in range(n):
        d[i] = a[i, i]


def _pair(a: float, b: float, c: float) -> tuple[float, float]:
    """The eigenvalues of the 2 x 2 symmetric ``[[a, b], [b, c]]`` (LAPACK's ``dlae2``)."""
    total, difference = a + c, abs(a - c)
    twice = abs(b + b)
    large, small = (a, c) if abs(a) > abs(c) else (c, a)
    if difference > twice:
        root = difference * np.sqrt(1.0 + (twice / difference) ** 2)
    elif difference < twice:
        root = twice * np.sqrt(1.0 + (difference / twice) ** 2)
    else:
        root = twice * np.sqrt(2.0)
    if total == 0.0:
        return 0.5 * root, -0.5 * root
    first = 0.5 * (total - root) if total < 0.0 else 0.5 * (total + root)
    return first, (large / first) * small - (b / first) * b


def _ql(d: np.ndarray, e: np.ndarray) -> bool:
    """Eigenvalues of the tridiagonal (``d``, ``e[1:]``) into ``d`` (``e`` destroyed); False if
    they took more than `MAX_SWEEPS` per eigenvalue in all. The root-free QL iteration of
    LAPACK's ``dsterf`` (Pal-Walker-Kahan): it runs on the squared off-diagonal, so a rotation
    takes two divisions and no square root; a 2 x 2 block that splits off is solved directly."""
    n = d.shape[0]
    for i in range(n - 1):  # e[i] := the square of the off-diagonal between d[i] and d[i + 1]
        e[i] = e[i + 1] * e[i + 1]
    e[n - 1] = 0.0
    sweeps = 0
    low = 0
    while low < n:
        m = low
        while m < n - 1 and e[m] > EPSILON_SQUARED * abs(d[m]) * abs(d[m + 1]) + SMALLEST:
            m += 1
        if m < n - 1:
            e[m] = 0.0
        if m == low:  # d[low] is an eigenvalue
            low += 1
            continue
        if m == low + 1:
            d[low], d[low + 1] = _pair(d[low], np.sqrt(e[low]), d[low + 1])
            e[low] = 0.0
            low += 2
            continue
        sweeps += 1
        if sweeps > MAX_SWEEPS * n:
            return False
        # The shift: the eigenvalue of the leading 2 x 2 nearer d[low] (Wilkinson's).
        root = np.sqrt(e[low])
        sigma = (d[low + 1] - d[low]) / (2.0 * root)
        r = np.sqrt(sigma * sigma + 1.0)
        sigma = d[low] - root / (sigma + (r if sigma >= 0.0 else -r))
        c = 1.0
        s = 0.0
        gamma = d[m] - sigma
        p = gamma * gamma
        for i in range(m - 1, low - 1, -1):
            squared = e[i]
            r = p + squared
            if i != m - 1:
                e[i + 1] = s * r
            previous_c = c
            c = p / r
            s = squared / r
            previous_gamma = gamma
            alpha = d[i]
            gamma = c * (alpha - sigma) - s * previous_gamma
            d[i + 1] = previous_gamma + (alpha - gamma)
            p = (gamma * gamma) / c if c != 0.0 else previous_c * squared
        e[low] = s * p
        d[low] = sigma + gamma
    return True


def _scale_into(matrix: np.ndarray, a: np.ndarray) -> float:
    """``matrix`` scaled by a power of two (exact) into ``a`` (same shape) so that its largest
    entry is in [1, 2); returns the exponent. The QL step's ``sqrt(f*f + g*g)`` (3x faster than
    ``hypot``) then cannot overflow or lose a value."""
    top = 0.0
    n = matrix.shape[0]
    for i in range(n):
        for j in range(n):
            x = abs(matrix[i, j])
            if x > top or x != x:  # a NaN stays: no scaling then, as for an infinity
                top = x
    exponent = 0.0
    if top > 0.0 and np.isfinite(top):
        exponent = min(max(np.floor(np.log2(top)), -1000.0), 1000.0)
    factor = 2.0**-exponent
    for i in range(n):
        for j in range(n):
            a[i, j] = matrix[i, j] * factor
    return exponent


def _eigenvalues(matrix: np.ndarray, out: np.ndarray, a: np.ndarray, e: np.ndarray) -> bool:
    # Three compiled calls, not one compiled function calling the others: numba's code for a
    # reassociating callee compiled into its caller differs between a fresh compile and its
    # cache, and processes must compute the same eigenvalues as the parent. ``a`` (n, n) and
    # ``e`` (n,) are work space, reused across matrices: a fresh 128 x 128 float64 buffer is
    # above malloc's mmap threshold, and its page faults cost as much as the reduction.
    exponent = _scale_into(matrix, a)
    _tridiagonalize(a, out, e)
    converged = _ql(out, e)
    out *= 2.0**exponent
    return bool(converged)


if numba is not None:
    _tridiagonalize = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})(
        _tridiagonalize
    )
    _pair = numba.njit(cache=True, nogil=True)(_pair)
    _ql = numba.njit(cache=True, nogil=True)(_ql)
    _scale_into = numba.njit(cache=True, nogil=True)(_scale_into)
elif native.AVAILABLE:
    _eigenvalues = native.eigenvalues

COMPILED = native.AVAILABLE or numba is not None


def eigenvalues(matrix: np.ndarray) -> np.ndarray:
    """The eigenvalues of symmetric ``matrix`` ``(n, n)`` float64, in descending order."""
    matrix = np.ascontiguousarray(matrix, dtype=np.float64)
    return eigenvalues_of(matrix[None])[0]


def eigenvalues_of(matrices: np.ndarray) -> np.ndarray:
    """The eigenvalues of each symmetric matrix of ``matrices`` ``(b, n, n)`` float64, each row
    of the result ``(b, n)`` in descending order."""
    matrices = np.ascontiguousarray(matrices, dtype=np.float64)
    count, n = matrices.shape[0], matrices.shape[-1]
    result = np.empty((count, n))
    if n == 0:
        return result
    if native.AVAILABLE:  # in C, four matrices at a time (native.QL_CHAINS)
        values, converged = native.eigenvalues_batch(matrices)
        for failed in np.flatnonzero(~converged):
            values[failed] = np.linalg.eigvalsh(matrices[failed])
        result[:] = np.sort(values, axis=-1)[:, ::-1]
        return result
    work, e, out = np.empty((n, n)), np.empty(n), np.empty(n)
    for b in range(count):
        if not COMPILED or not _eigenvalues(matrices[b], out, work, e):
            result[b] = np.linalg.eigvalsh(matrices[b])[::-1]  # no compiled solver, or no convergence
        else:
            result[b] = np.sort(out)[::-1]
    return result
