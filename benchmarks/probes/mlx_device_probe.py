"""The mlx backend's device work alone, by statistics group and batch size, on resident data (no
file, no host work): which part of the per-piece computation sets the pace of an mlx pass, and
how its time grows with the pieces stacked into one call and with processes sharing the device.

    python -m benchmarks.probes.mlx_device_probe [--dtypes bfloat16,float32] [--batches 1,8,16]
        [--processes 1,4,12]

Prints one JSON object per line: ``{"dtype", "groups", "batch", "ms_per_piece", "elements_per_s"}``
and, with ``--processes``, the device throughput of the full selection with that many processes
each calling it at once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from typing import Any

import numpy as np

SELECTIONS: dict[str, tuple[bool, bool, bool, bool, bool, bool]] = {
    # (norms, channels, rope, mean, gram, quant), as `mlx_backend.piece_flags` gives them
    "all": (True, True, True, True, True, True),
    "norms": (True, False, False, False, False, False),
    "channels": (False, True, False, True, False, False),
    "spectrum": (False, False, False, True, True, False),
    "quant": (False, False, False, False, False, True),
    "square_sum_only": (False, False, False, False, False, False),
}


def _inputs(dtype: str, batch: int, seed: int = 0) -> tuple[Any, Any]:
    import mlx.core as mx

    from kvsnap.analysis.kernels import mlx_fold
    from kvsnap.analysis.kernels.arrays import PIECE

    mx.random.seed(seed)
    x = mx.random.normal((batch, PIECE, 128)).astype(getattr(mx, dtype))
    bins = mx.array(np.stack([mlx_fold.piece_bins(np.arange(PIECE))] * batch))
    mx.eval(x, bins)
    return x, bins


def time_selection(dtype: str, groups: str, batch: int, seconds: float = 1.0) -> dict[str, Any]:
    """Milliseconds per piece of the compiled, batched device function for ``groups``."""
    import mlx.core as mx

    from kvsnap.analysis.kernels import mlx as mlx_backend
    from kvsnap.analysis.kernels.arrays import PIECE

    flags = SELECTIONS[groups]
    function = mlx_backend.piece_function(*flags, batched=True)
    x, bins = _inputs(dtype, batch)
    inputs = (x, bins) if flags[0] else (x,)
    for _ in range(3):
        mx.eval(function(*inputs))
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < 5:
        mx.eval(function(*inputs))
        calls += 1
    elapsed = time.perf_counter() - start
    per_piece = elapsed / calls / batch
    return {
        "dtype": dtype,
        "groups": groups,
        "batch": batch,
        "ms_per_piece": round(per_piece * 1e3, 4),
        "elements_per_s": round(PIECE * 128 / per_piece),
    }


def _worker(args: tuple[str, int, int, Any]) -> float:
    dtype, batch, calls, barrier = args
    import mlx.core as mx

    from kvsnap.analysis.kernels import mlx as mlx_backend

    function = mlx_backend.piece_function(*SELECTIONS["all"], batched=True)
    x, bins = _inputs(dtype, batch)
    for _ in range(3):
        mx.eval(function(x, bins))
    barrier.wait()
    start = time.perf_counter()
    for _ in range(calls):
        mx.eval(function(x, bins))
    return time.perf_counter() - start


def concurrent(dtype: str, batch: int, processes: int, calls: int) -> dict[str, Any]:
    """Every one of ``processes`` processes calls the full selection ``calls`` times at once."""
    from kvsnap.analysis.kernels.arrays import PIECE

    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(processes)
        with context.Pool(processes) as pool:
            times = pool.map(_worker, [(dtype, batch, calls, barrier)] * processes)
    pieces = processes * calls * batch
    slowest = max(times)
    return {
        "dtype": dtype,
        "processes": processes,
        "batch": batch,
        "ms_per_piece_all": round(slowest / pieces * 1e3, 4),
        "elements_per_s": round(pieces * PIECE * 128 / slowest),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--groups", default=",".join(SELECTIONS))
    parser.add_argument("--processes", default="")
    args = parser.parse_args()
    import mlx.core as mx

    print(json.dumps({"device": str(mx.default_device())}), flush=True)
    for dtype in args.dtypes.split(","):
        for groups in args.groups.split(","):
            for batch in [int(b) for b in args.batches.split(",")]:
                print(json.dumps(time_selection(dtype, groups, batch)), flush=True)
        for processes in [int(p) for p in args.processes.split(",") if p]:
            print(json.dumps(concurrent(dtype, 8, processes, 24)), flush=True)


if __name__ == "__main__":
    main()
