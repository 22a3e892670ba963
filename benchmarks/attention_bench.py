"""Attention offline: `snap.attention` for one query head over 8192 keys x 64 queries,
from an open file, against the same arithmetic on arrays already in memory (numpy, float32: the
floor the file path can reach) in the same run; peak traced memory of the call.

    python -m benchmarks.attention_bench [--keys 8192] [--queries 64] [--dim 128] [--rounds 15]

The file: a Qwen3-8B-shaped layer (8 KV heads, 32 query heads, head_dim 128, bfloat16), 8192
positions, queries stored for the last 64 (``--queries window:64``). Reported: median and spread of
``open + attention`` in a running process, imports done (per file a script opens) and of
``attention`` on an open file (per head in a loop), the in-memory floor, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np

import kvformat
from benchmarks.timing import blas_line
from kvformat import QuerySpec, attention


def build(path: Path, keys: int, queries: int, dim: int) -> None:
    rng = np.random.default_rng(0)
    kv_heads, q_heads = 8, 32
    spec = kvformat.LayerSpec(
        kv_heads,
        dim,
        dim,
        kvformat.BFLOAT16,
        queries=QuerySpec(
            num_heads=q_heads,
            dim=dim,
            dtype=kvformat.BFLOAT16,
            scale=dim**-0.5,
            kv_heads=tuple(h // (q_heads // kv_heads) for h in range(q_heads)),
        ),
    )
    k = rng.standard_normal((kv_heads, keys, dim), dtype=np.float32).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((kv_heads, keys, dim), dtype=np.float32).astype(ml_dtypes.bfloat16)
    q = rng.standard_normal((q_heads, queries, dim), dtype=np.float32).astype(ml_dtypes.bfloat16)
    with kvformat.Writer(path, [spec], durable=False) as writer:
        writer.append(0, k, v)
        writer.append_queries(0, q, np.arange(keys - queries, keys))


def timed(function: object, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()  # type: ignore[operator]
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=8192)
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(blas_line())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "attention.kv"
        build(path, args.keys, args.queries, args.dim)
        head = 5

        def cold() -> None:
            with kvformat.open(path) as snap:
                snap.attention(0, head)

        with kvformat.open(path) as snap:
            spec = snap.layers[0].queries
            assert spec is not None
            snap.attention(0, head)  # page cache warm
            warm = timed(lambda: snap.attention(0, head), args.rounds)
            found = snap.queries(0, head)
            kv = snap.head(0, spec.kv_heads[head])
            assert found is not None and kv is not None
            q32, k32 = found.q.astype(np.float32), kv.k.astype(np.float32)
            floor = timed(
                lambda: attention.weights(spec, head, q32, k32, found.positions, kv.positions), args.rounds
            )
            tracemalloc.start()
            snap.attention(0, head)
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        fresh = timed(cold, args.rounds)

    def line(name: str, times: list[float]) -> str:
        median = statistics.median(times) * 1e3
        return f"{name:44s} median {median:7.2f} ms  (min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f})"

    print(f"one query head, {args.keys} keys x {args.queries} queries, head_dim {args.dim}, bfloat16 file")
    print(line("open + snap.attention (running process)", fresh))
    print(line("snap.attention on an open file", warm))
    print(line("floor: the same float32 math in memory", floor))
    print(f"open file / floor: {statistics.median(warm) / statistics.median(floor):.2f}x")
    size = args.queries * args.keys * 4 / 2**20
    print(f"peak traced memory of snap.attention: {peak / 2**20:.1f} MiB (the map itself: {size:.1f} MiB)")


if __name__ == "__main__":
    main()
