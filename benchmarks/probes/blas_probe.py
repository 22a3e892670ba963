"""Do BLAS and the numpy pieces of the Gram update scale over threads on this machine?

    python -m benchmarks.probes.blas_probe [--jobs 1,4,8,16]

For each thread count: float32 ``x.T @ x`` on (512, 128) pieces under a one-thread BLAS, the
same with BLAS's own threads, ``np.median`` of 8192 floats, and the spectrum-only accumulator.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvsnap.analysis.engine.accumulator import HeadAccumulator
from kvsnap.analysis.engine.parallel import single_threaded_blas
from kvsnap.analysis.stats import stat_groups


def rate(jobs: int, work: Callable[[], None], repeat: int) -> float:
    """Calls per second of ``work`` over ``jobs`` threads, ``repeat`` calls each."""

    def run(_: int) -> None:
        for _ in range(repeat):
            work()

    run(0)
    start = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run, range(jobs)))
    return jobs * repeat / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", default=f"1,4,8,{os.cpu_count()}")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    piece = rng.standard_normal((512, 128), dtype=np.float32)
    rows = rng.standard_normal((8192, 128), dtype=np.float32)
    positions = np.arange(8192)
    spectrum = stat_groups("spectrum")
    cases: dict[str, tuple[Callable[[], None], int, bool]] = {
        "sgemm 512x128 (one-thread BLAS)": (lambda: piece.T @ piece, 400, True),
        "sgemm 512x128 (BLAS threads)": (lambda: piece.T @ piece, 400, False),
        "median of 8192": (lambda: np.median(positions.astype(np.float64)), 400, True),
        "spectrum add of 8192 rows": (
            lambda: HeadAccumulator(128, groups=spectrum).add(rows, positions),
            10,
            True,
        ),
    }
    for name, (work, repeat, limited) in cases.items():
        base = None
        for jobs in [int(j) for j in args.jobs.split(",")]:
            if limited:
                with single_threaded_blas():
                    value = rate(jobs, work, repeat)
            else:
                value = rate(jobs, work, repeat)
            base = base or value
            print(f"{name:34s} jobs {jobs:2d}: {value:9.0f} calls/s, {value / base:5.2f}x one thread")


if __name__ == "__main__":
    main()
