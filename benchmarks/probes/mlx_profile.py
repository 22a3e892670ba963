"""Where the time of an mlx pass goes, on the machine that runs it: the host memory of mlx alone,
then one `stats_for_file(..., backend="mlx")` pass with timers around its stages (reading and
checksumming, stacking a batch, the copy to the device (staging buffers, or ``mx.array`` with
``--no-staging``), waiting for the device, folding results,
eigenvalues), and mlx's own memory counters.

    python -m benchmarks.probes.mlx_profile FILE [--stats all] [--batch-mib 32] [--cache-limit-mib N]
        [--no-staging]
        [--repeat 2] [--row-threads N] [--copy-threads N] [--switch-interval SECONDS]

Each pass's time goes to stderr as it ends (``pass N: S s``: a profiler can attach after the
first, which compiles); the report (stdout, JSON) also gives the resident set by kind
(anonymous, file-backed) after mlx starts and at the end.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_totals: dict[str, float] = collections.defaultdict(float)
_counts: dict[str, int] = collections.defaultdict(int)
_lock = threading.Lock()


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            with _lock:
                _totals[name] += time.perf_counter() - start
                _counts[name] += 1

    return wrapper


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rss_parts_mib() -> dict[str, float]:
    """This process's resident set now, by kind (Linux: anonymous, file-backed, shared memory)."""
    parts: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon", "RssFile", "RssShmem")):
                    name, value = line.split(":")
                    parts[name] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("file")
    parser.add_argument("--stats", default="all")
    parser.add_argument("--batch-mib", type=int, default=None)
    parser.add_argument("--cache-limit-mib", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--no-staging", action="store_true", help="mx.array per piece instead of staging buffers"
    )
    parser.add_argument("--row-threads", type=int, default=None, help="instead of row_threads()")
    parser.add_argument("--copy-threads", type=int, default=None, help="instead of copy_threads()")
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (seconds)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    import mlx.core as mx

    report: dict[str, Any] = {"device": str(mx.default_device())}
    mx.eval(mx.ones((1024, 1024)) @ mx.ones((1024, 1024)))
    report["rss_after_mlx_init_mib"] = _current_rss_mib()
    report["rss_after_mlx_init_parts_mib"] = _rss_parts_mib()
    if args.cache_limit_mib is not None:
        mx.set_cache_limit(args.cache_limit_mib << 20)

    import kvformat
    from kvsnap.analysis.engine import tables as stats
    from kvsnap.analysis.kernels import mlx as mlx_backend
    from kvsnap.analysis.kernels import mlx_fold, mlx_pipeline, mlx_sizing, mlx_staging

    if args.batch_mib is not None or args.no_staging:
        original = mlx_pipeline.Pipeline.__init__
        limit = (args.batch_mib or 32) << 20

        def init(self: Any, limit_: int = limit) -> None:
            original(self, limit_, staging=not args.no_staging)

        mlx_pipeline.Pipeline.__init__ = init  # type: ignore[method-assign]
    report["staging"] = not args.no_staging
    if args.row_threads is not None:
        mlx_sizing.row_threads = lambda share=1: args.row_threads  # type: ignore[assignment]
    if args.copy_threads is not None:
        mlx_sizing.copy_threads = lambda share=1: args.copy_threads  # type: ignore[assignment]
    report["threads"] = {"rows": mlx_sizing.row_threads(), "copies": mlx_sizing.copy_threads()}
    report["switch_interval"] = sys.getswitchinterval()

    # warm: compile the device functions
    with kvformat.open(args.file) as snap:
        block = next(iter(snap.blocks()))
        for rows in (block.k, block.v):
            acc = stats.HeadAccumulator(rows.shape[1], None, stats.stat_groups(args.stats), backend="mlx")
            acc.add(rows, block.positions)
            acc.settle()
    report["rss_after_warm_mib"] = _current_rss_mib()

    kvformat.Snapshot.read = _timed("read+crc (worker)", kvformat.Snapshot.read)  # type: ignore[method-assign]
    from kvformat.pages import Pages

    unchecked = _timed("read, CRCs left to the copy threads (driver)", Pages.read_unchecked)
    Pages.read_unchecked = unchecked  # type: ignore[method-assign]
    mlx_pipeline._Batch.launch = _timed(
        "batch launch (waits for its copies, driver)", mlx_pipeline._Batch.launch
    )  # type: ignore[method-assign]
    mlx_staging._Fill.result = _timed("copies waited for (driver)", mlx_staging._Fill.result)  # type: ignore[method-assign]
    mlx_pipeline.Pipeline.add = _timed("pipeline add (driver)", mlx_pipeline.Pipeline.add)  # type: ignore[method-assign]
    mlx_backend.to_device = _timed("to device (mx.array per piece)", mlx_backend.to_device)
    staging = mlx_staging.Staging
    staging.fill = _timed("to device (staging copy per group)", staging.fill)  # type: ignore[method-assign]
    batch = mlx_pipeline._Batch
    batch.__init__ = _timed("batch send (total, driver)", batch.__init__)  # type: ignore[method-assign]
    batch.fetch = _timed("batch fetch (wait + results to host, driver)", batch.fetch)  # type: ignore[method-assign]
    batch._fold_all = _timed("fold (fold thread)", batch._fold_all)  # type: ignore[method-assign]
    mlx_fold.fold_group = _timed("fold one group of pieces (host numpy)", mlx_fold.fold_group)
    row = stats.HeadAccumulator.row
    stats.HeadAccumulator.row = _timed("row (eigenvalues; threads)", row)  # type: ignore[method-assign]

    report["seconds"] = []
    for _ in range(args.repeat):  # the first run compiles the batched functions
        _totals.clear()
        _counts.clear()
        mx.reset_peak_memory()
        start = time.perf_counter()
        rows = sum(t.num_rows for t in stats.stats_for_file(args.file, stats=args.stats, backend="mlx"))
        report["seconds"].append(round(time.perf_counter() - start, 3))
        print(f"pass {len(report['seconds'])}: {report['seconds'][-1]} s", file=sys.stderr, flush=True)
        report["rows"] = rows
    report["stages_s"] = {k: round(v, 3) for k, v in sorted(_totals.items())}
    report["stage_calls"] = dict(sorted(_counts.items()))
    report["peak_rss_mib"] = _rss_mib()
    report["rss_at_end_parts_mib"] = _rss_parts_mib()
    report["mlx_peak_mib"] = mx.get_peak_memory() / 2**20
    report["mlx_cache_mib"] = mx.get_cache_memory() / 2**20
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
