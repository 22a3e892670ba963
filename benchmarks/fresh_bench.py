"""Where a fresh ``kvsnap stats FILE`` spends its time, one process, in order: the imports, the
worker pool's start (fork server, kernels, workers), the first pass over the file and a second
pass in the same process (the warm figure), each as a wall-clock delta.

    python -m benchmarks.fresh_bench FILE [--jobs 16] [--backend cpu]
    python -m benchmarks.fresh_bench FILE --jobs 1 --backend mlx   # the command's mlx pass

Run it after byte-compiling the sources (``python -m compileall -q kvformat analysis capture``),
as a ``pip install`` leaves them.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    marks: list[tuple[str, float]] = []

    def mark(label: str) -> None:
        marks.append((label, time.perf_counter()))

    import numpy  # noqa: F401

    import kvformat  # noqa: F401

    mark("import numpy, kvformat")
    from kvsnap.analysis.engine import processes
    from kvsnap.analysis.engine.batch import run_stats

    mark("import the analysis")
    if args.backend == "mlx" and args.jobs == 1:  # the command's one mlx pass in its own process
        import mlx.core as mx

        mx.eval(mx.zeros(1) + 1)
        mark(f"mlx and {mx.default_device()} started")
    elif args.jobs > 1:
        workers = processes.worker_count(args.jobs, args.backend)
        processes.start(workers, args.backend)
        pool = processes._pool(workers, args.backend)
        for future in [pool.submit(int) for _ in range(workers)]:
            future.result()
        mark(f"{workers} workers ready")
    rows = run_stats(args.file, jobs=args.jobs, backend=args.backend).rows
    mark(f"first pass ({rows.num_rows} rows)")
    run_stats(args.file, jobs=args.jobs, backend=args.backend)
    mark("second pass")
    last = START
    for label, at in marks:
        print(f"{label:32s} +{at - last:6.3f} s  (at {at - START:6.3f} s)")
        last = at


if __name__ == "__main__":
    main()
