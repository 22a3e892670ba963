"""How many workers a pass may use and how BLAS behaves beside them: this process's cores
(`analysis.machine.cores`), the split of a batch's cores between files and each file's workers,
BLAS on one thread while our own workers (`engine.executors`) spread the work (N workers x a BLAS
pool each would oversubscribe the cores, and results would depend on the thread count).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..dependencies import kvformat_errors, threadpoolctl
from ..machine import cores

__all__ = ["cores", "limit_blas_threads", "single_threaded_blas", "split_jobs"]


def split_jobs(jobs: int, files: int) -> tuple[int, int]:
    """``(processes, threads per file)`` for ``jobs`` cores over ``files`` files: files in
    parallel first (no sharing at all), the cores left over as threads within each file."""
    if jobs < 1:
        raise kvformat_errors.InvalidArgumentError(f"jobs must be at least 1, not {jobs}")
    processes = max(1, min(jobs, files))
    return processes, max(1, jobs // processes)


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """BLAS limited to one thread while a pass runs: our own threads spread the work (N threads x
    a BLAS pool each would oversubscribe the cores), and results do not depend on the thread
    count. A no-op where threadpoolctl is not installed."""
    try:
        limits = threadpoolctl.threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with the analysis extra
        yield
        return
    with limits(1, user_api="blas"):
        yield


def limit_blas_threads(threads: int) -> None:
    """BLAS limited to ``threads`` threads from now on in this process (a no-op where
    threadpoolctl is not installed)."""
    try:
        limits = threadpoolctl.threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl comes with the analysis extra
        return
    limits(threads, user_api="blas")
