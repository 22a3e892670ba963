"""Batch benchmark: per-head statistics over a set of snapshots with local processes and with Ray
(local mode), and one-head reads from remote storage vs local, in one run.

    python -m benchmarks.batch_bench [--dir /tmp/kvsnap-batch-bench] [--files 16] [--quick]

The set: ``--files`` (8) Qwen3-8B-shaped bfloat16 snapshots of 1024 tokens (36 layers x 8 KV heads x
128 dims, 151 MB each) plus one of 16384 tokens (2.4 GB), raw codec. Each engine runs in a fresh
child process; the parent samples the resident memory of that process and all its descendants
(Ray's raylet, GCS and workers included) from /proc every 0.1 s (Linux). Both engines must give
the same table. Remote reads: nginx and moto's S3 API on loopback (as in the tests), one head of
the big file, against a local memory-mapped read and against downloading the whole file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import ml_dtypes

import kvformat
from benchmarks.analysis_bench import write
from benchmarks.memory import descendants, rss
from tests.servers import moto_s3, nginx

LAYERS, HEADS, DIM = 36, 8, 128


CHILD = r"""
import json, sys, time
engine, jobs, out, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
start = time.perf_counter()
init = 0.0
if engine == "ray":
    import ray
    ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
    init = time.perf_counter() - start
from kvsnap.analysis.engine.batch import run_stats
result = run_stats(paths, engine=engine, jobs=jobs)
result.table.write_parquet(out)
print(json.dumps({"seconds": time.perf_counter() - start, "init": init, "rows": result.table.height,
                  "failures": len(result.failures)}))
"""


def run_engine(engine: str, jobs: int, paths: list[str], out: Path) -> dict[str, float]:
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, engine, str(jobs), str(out), *paths],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    peak_total = peak_one = 0
    while process.poll() is None:
        sizes = [rss(pid) for pid in descendants(process.pid)]
        peak_total = max(peak_total, sum(sizes))
        peak_one = max(peak_one, max(sizes, default=0))
        time.sleep(0.1)
    stdout, _ = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{engine} engine failed with status {process.returncode}")
    result = dict(json.loads(stdout.strip().splitlines()[-1]))
    result.update(peak_total=peak_total, peak_one=peak_one)
    return result


def sequential_read(paths: list[str]) -> float:
    buffer = memoryview(bytearray(16 << 20))
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def timed(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def remote_rows(big: Path, directory: Path) -> list[str]:
    """One-head reads of ``big``: local mmap, HTTP (nginx), S3 (moto), whole-file download."""
    layer, head = LAYERS // 2, HEADS // 2
    with kvformat.open(big) as snap:
        stored = sum(
            snap._file.chunk(c).stored_size + 64
            for s in snap.segments()
            if (s.layer, s.head) == (layer, head)
            for c in (s.k_chunk, s.v_chunk)
        )

    def read(location: str, **options: object) -> int:
        with kvformat.open(location, **options) as snap:  # type: ignore[arg-type]
            data = snap.head(layer, head)
            assert data is not None
            source = snap._file.source
            return int(getattr(source, "bytes_fetched", 0))

    rows = []
    local = timed(lambda: read(str(big)))
    rows.append(f"| local mmap | {local * 1e3:.1f} ms | - | 1.00x |")
    with tempfile.TemporaryDirectory() as work:
        root = Path(work) / "www"
        root.mkdir()
        os.symlink(big, root / big.name)
        with nginx(root, Path(work) / "nginx") as server:
            url = server.url(big.name)
            http = timed(lambda: read(url))
            fetched = read(url)
            rows.append(
                f"| HTTP (nginx, loopback) | {http * 1e3:.1f} ms | {fetched / 1e6:.1f} MB "
                f"({fetched / stored:.2f}x the head's {stored / 1e6:.1f} MB) | {http / local:.2f}x |"
            )

            def download() -> None:
                with urllib.request.urlopen(url) as response:
                    while response.read(16 << 20):
                        pass

            whole = timed(download, repeats=1)
            size = big.stat().st_size
            rows.append(
                f"| peer: download the whole file over HTTP | {whole * 1e3:.0f} ms | {size / 1e9:.2f} GB "
                f"({size / whole / 1e9:.2f} GB/s) | {whole / local:.0f}x |"
            )
        with moto_s3() as s3:
            s3.upload(big, big.name)
            options = s3.storage_options
            key = f"s3://{s3.bucket}/{big.name}"
            s3_time = timed(lambda: read(key, storage_options=options))
            fetched = read(key, storage_options=options)
            rows.append(
                f"| S3 (moto server, s3fs, loopback) | {s3_time * 1e3:.1f} ms | {fetched / 1e6:.1f} MB "
                f"| {s3_time / local:.2f}x |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/kvsnap-batch-bench")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--quick", action="store_true", help="small files, a 150 MB big one")
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    small_tokens, big_tokens = (128, 1024) if args.quick else (1024, 16384)
    paths = []
    for i in range(args.files):
        path = directory / f"run{i:03d}-{small_tokens}.kv"
        write(path, LAYERS, HEADS, DIM, small_tokens, ml_dtypes.bfloat16, "raw")
        paths.append(str(path))
    big = directory / f"big-{big_tokens}.kv"
    write(big, LAYERS, HEADS, DIM, big_tokens, ml_dtypes.bfloat16, "raw")
    paths.append(str(big))
    total = sum(os.path.getsize(p) for p in paths)
    sequential_read(paths)  # warm the page cache alike for every contender
    read = sequential_read(paths)
    lines = [
        f"{len(paths)} files, {total / 1e9:.2f} GB (largest {big.stat().st_size / 1e9:.2f} GB), "
        f"{args.jobs} workers, {os.cpu_count()} CPUs; sequential read {total / read / 1e9:.2f} GB/s",
        "",
        "| engine | time | files/s | GB/s | vs local | peak RSS, one process | peak RSS, all processes |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    results = {}
    tables = {}
    for engine in ("local", "ray"):
        out = directory / f"stats-{engine}.parquet"
        results[engine] = r = run_engine(engine, args.jobs, paths, out)
        tables[engine] = out
        note = f" (of which Ray start {r['init']:.1f} s)" if engine == "ray" else ""
        lines.append(
            f"| {engine} | {r['seconds']:.1f} s{note} | {len(paths) / r['seconds']:.2f} "
            f"| {total / r['seconds'] / 1e9:.3f} | {results['local']['seconds'] / r['seconds']:.2f}x "
            f"| {r['peak_one'] / 2**20:.0f} MiB | {r['peak_total'] / 2**20:.0f} MiB |"
        )
        print(lines[-1], file=sys.stderr)
    import polars as pl

    same = pl.read_parquet(tables["local"]).equals(pl.read_parquet(tables["ray"]))
    lines.append("")
    lines.append(f"tables identical: {same}")
    lines += [
        "",
        f"One head (layer {LAYERS // 2}, head {HEADS // 2}) of {big.name}, open + read, best of 3:",
        "",
        "| source | time | transferred | vs local |",
        "|---|---:|---:|---:|",
        *remote_rows(big, directory),
    ]
    print("\n".join(lines))
    if not same:
        raise SystemExit("the engines disagree")


if __name__ == "__main__":
    main()
