"""Shared timing helpers for the benchmarks."""

from __future__ import annotations

import compileall
import time
from collections.abc import Callable
from pathlib import Path


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


DEPENDENCIES = ("numpy", "pyarrow", "ml_dtypes", "zstandard", "crc32c", "threadpoolctl", "mlx")
"""Third-party packages a fresh ``kvsnap stats`` imports (``--backend mlx``: mlx too); those installed
are byte-compiled too."""


def byte_compile() -> int:
    """kvsnap's packages and its `DEPENDENCIES` byte-compiled where they are, as ``pip install``
    leaves them (a no-op for an installed wheel's); returns the dependencies' modules that had no
    bytecode before. An environment that installed them without it (the accelerator machine's
    numpy, with ``PYTHONDONTWRITEBYTECODE`` set) makes every fresh process compile numpy from
    source: 0.1-0.2 s of each ``import numpy`` there, in the command and again in its fork
    server (the benchmarks in `benchmarks/`)."""
    import importlib.util

    missing = 0
    for package in ("kvformat", "kvsnap", "kvsnap.analysis", "kvsnap.capture", *DEPENDENCIES):
        try:
            spec = importlib.util.find_spec(package)
        except ImportError:  # pragma: no cover - a dependency not installed here
            continue
        folders = spec.submodule_search_locations if spec is not None else None
        for folder in folders or []:
            if package in DEPENDENCIES:
                missing += sum(
                    not Path(importlib.util.cache_from_source(str(path))).exists()
                    for path in Path(folder).rglob("*.py")
                )
            compileall.compile_dir(folder, quiet=1)
    return missing
