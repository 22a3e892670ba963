"""Shared timing helper for the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    """The fastest of ``repeats`` runs of ``fn``, in seconds (the least disturbed by noise)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def blas_line() -> str:
    """Which BLAS kernels numpy runs in this process, for a benchmark's header: BLAS-bound figures
    (Gram products, eigenvalues, the attention group's products) depend on them, and an
    ``OPENBLAS_CORETYPE`` set in the environment overrides the kernels a user would get
    (`benchmarks.blas_bench` measures the difference)."""
    import os

    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "BLAS: unknown (no threadpoolctl)"
    import numpy  # noqa: F401  (loads numpy's BLAS, so that threadpoolctl finds it)

    found = [
        f"{info.get('internal_api')} {info.get('version')}, {info.get('architecture')} kernels"
        for info in threadpool_info()
        if info.get("user_api") == "blas"
    ]
    line = "BLAS: " + ("; ".join(found) or "none found")
    forced = os.environ.get("OPENBLAS_CORETYPE")
    if forced:
        line += (
            f" (OPENBLAS_CORETYPE={forced} is set in this environment: BLAS-bound figures are those"
            " kernels', not the ones numpy picks by default; `python -m benchmarks.blas_bench` compares)"
        )
    return line
