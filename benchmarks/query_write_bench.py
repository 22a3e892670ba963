"""What a snapshot's queries cost the writer thread: `kvformat.Writer.append_queries` for every
layer, then ``snapshot()``, against the floor of writing the same number of bytes with one
``os.write`` of a ready buffer, in the same run (alternated rounds, no fsync for either).

A 36-layer model's ``--queries window:64`` snapshot (Qwen3-8B's shapes: 32 query heads, head_dim
128, bf16, 64 positions a snapshot): 1,152 Q chunks of 16 KiB, raw, as capture writes them. What
is timed is the writer's own work (descriptors, CRC-32C, table, ``writev``), in milliseconds per
snapshot.

    python -m benchmarks.query_write_bench [--snapshots 8] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import kvformat
from kvformat import QuerySpec

LAYERS, QUERY_HEADS, KV_HEADS, DIM, ROWS = 36, 32, 8, 128, 64


def writer_ms(path: Path, queries: np.ndarray, snapshots: int) -> tuple[float, int]:
    """Milliseconds per snapshot of queries, and the file's size in bytes."""
    groups = [h // (QUERY_HEADS // KV_HEADS) for h in range(QUERY_HEADS)]
    spec = QuerySpec(QUERY_HEADS, DIM, kvformat.BFLOAT16, DIM**-0.5, groups)
    layer = kvformat.LayerSpec(KV_HEADS, DIM, DIM, kvformat.BFLOAT16, {"kind": "full"}, queries=spec)
    layers = [layer] * LAYERS
    times = []
    with kvformat.Writer(path, layers, durable=False) as writer:
        for index in range(snapshots):
            positions = np.arange(index * ROWS, (index + 1) * ROWS)
            start = time.perf_counter()
            for layer in range(LAYERS):
                writer.append_queries(layer, queries, positions)
            writer.snapshot()
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), path.stat().st_size


def floor_ms(path: Path, size: int, snapshots: int) -> float:
    """Milliseconds per snapshot to write ``size / snapshots`` ready bytes with one ``os.write``."""
    buffer = np.ones(size // snapshots, np.uint8)
    times = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(snapshots):
            start = time.perf_counter()
            os.write(fd, buffer.data)
            times.append(time.perf_counter() - start)
    finally:
        os.close(fd)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    queries = np.random.default_rng(0).standard_normal((QUERY_HEADS, ROWS, DIM)).astype(ml_dtypes.bfloat16)
    writer_runs, floor_runs = [], []
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):  # alternated, so drift falls on both
            path = Path(folder) / f"q{round_}.kv"
            found, size = writer_ms(path, queries, args.snapshots)
            writer_runs.append(found)
            path.unlink()
            floor_runs.append(floor_ms(path, size, args.snapshots))
            path.unlink()
    writer, floor = statistics.median(writer_runs), statistics.median(floor_runs)
    print(
        f"queries of one snapshot ({LAYERS} layers x {QUERY_HEADS} heads x {ROWS} rows, bf16, "
        f"{LAYERS * QUERY_HEADS} chunks): writer {writer:.1f} ms (rounds {min(writer_runs):.1f}-"
        f"{max(writer_runs):.1f}); one os.write of as many bytes {floor:.2f} ms "
        f"({min(floor_runs):.2f}-{max(floor_runs):.2f}); {writer / floor:.1f}x the floor"
    )


if __name__ == "__main__":
    main()
