"""Where a one-file pass stops scaling: CPU seconds (user, system) over wall seconds, per statistic
group and thread count, on the file and on the same arithmetic without any file (in-memory rows,
one accumulator per thread).

    python -m benchmarks.probes.util_probe FILE [--jobs 16,8,4] [--groups all,norms,spectrum,quant]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvsnap.analysis.engine.accumulator import HeadAccumulator
from kvsnap.analysis.engine.parallel import single_threaded_blas
from kvsnap.analysis.engine.tables import stats_for_file
from kvsnap.analysis.stats import stat_groups


def timed(work: object) -> tuple[float, float, float]:
    before, start = os.times(), time.perf_counter()
    work()  # type: ignore[operator]
    after, wall = os.times(), time.perf_counter() - start
    return wall, (after.user - before.user) / wall, (after.system - before.system) / wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--jobs", default=f"{os.cpu_count()}")
    parser.add_argument("--groups", default="all")
    args = parser.parse_args()
    rows = np.random.default_rng(0).standard_normal((8192, 128), dtype=np.float32)
    positions = np.arange(8192)
    for groups in args.groups.split(","):
        for jobs in [int(j) for j in args.jobs.split(",")]:

            def on_file(jobs: int = jobs, groups: str = groups) -> None:
                sum(t.num_rows for t in stats_for_file(args.file, stats=groups, jobs=jobs))

            wall, user, system = timed(on_file)
            cpu = f"{user:4.1f} user + {system:4.1f} sys cores"
            print(f"file   {groups:9s} jobs {jobs:2d}: {wall:6.2f} s, {cpu}")

            def memory(jobs: int = jobs, groups: str = groups) -> None:
                def one(_: int) -> None:
                    for _ in range(8):
                        HeadAccumulator(128, groups=stat_groups(groups)).add(rows, positions)

                with single_threaded_blas(), ThreadPoolExecutor(jobs) as pool:
                    list(pool.map(one, range(jobs)))

            wall, user, system = timed(memory)
            rate = jobs * 8 * rows.nbytes / wall / 1e9
            cpu = f"{user:4.1f} user + {system:4.1f} sys cores"
            print(f"memory {groups:9s} jobs {jobs:2d}: {rate:6.2f} GB/s, {cpu}")


if __name__ == "__main__":
    main()
