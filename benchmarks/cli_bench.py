"""`kvsnap stats FILE -o out.parquet` as a user runs it: a fresh process each time, default
settings, end to end (interpreter, imports, workers, the pass, the Parquet file), against the
machine's own sequential read of the same file in the same run.

    python -m benchmarks.cli_bench [--dir /tmp/kvsnap-cli-bench] [--runs 5] [--backends cpu,mlx]

Files (written once, then reused): two tiny ones (2 layers x 2 heads x 40 tokens, float32 and
bfloat16: the fixed cost, the second with ml_dtypes' import) and the Qwen3-8B-shaped bfloat16 one
of `benchmarks.analysis_bench` (36 x 8 x 128 x 8192 tokens, 1.2 GB). Each row: median and range
over ``--runs`` fresh runs, the largest resident set of any process of the run and the PSS of the
whole process tree (`benchmarks.memory`), and the ratio of the read's time to the command's (1.0x:
as fast as reading the file once; higher is faster). The page cache is warm: each file is read
once before its runs, and kvsnap's modules are byte-compiled first, as ``pip install`` leaves them
(where ``PYTHONDONTWRITEBYTECODE`` is set, as on the accelerator machine, every fresh process
would otherwise compile them from source: 0.13 s and more of each run there).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvformat
from benchmarks.analysis_bench import SHAPES, write
from benchmarks.memory import run_sampled
from benchmarks.timing import blas_line

COMMAND = "import sys; from kvsnap.launch import main; raise SystemExit(main(sys.argv[1:]))"
"""What the ``kvsnap`` console script runs."""


def files(directory: Path) -> dict[str, Path]:
    """The benchmark's files, written if missing."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny, tiny_bf16 = directory / "tiny.kv", directory / "tiny-bf16.kv"
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((2, 40, 16)).astype(np.float32) for _ in range(2))
    for path, dtype in ((tiny, np.float32), (tiny_bf16, SHAPES["qwen3-8b-bf16"][3])):
        if not path.exists():
            k16, v16 = k.astype(dtype), v.astype(dtype)
            kvformat.save(path, [kvformat.Layer(k16, v16), kvformat.Layer(v16, k16)])
    big = directory / "qwen3-8b-bf16.kv"
    if not big.exists():
        layers, heads, dim, dtype = SHAPES["qwen3-8b-bf16"]
        write(big, layers, heads, dim, 8192, dtype, "raw")
    return {
        "tiny (2 x 2 x 40 float32)": tiny,
        "tiny (2 x 2 x 40 bfloat16)": tiny_bf16,
        "Qwen3-8B bf16, 8192 tokens": big,
    }


def read_seconds(path: Path) -> float:
    """The fastest of three sequential reads of ``path`` by a fresh ``cat`` (the page cache warm)."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return min(times)


def byte_compile() -> None:
    """kvsnap's packages byte-compiled where they are (a no-op for an installed wheel's)."""
    import compileall
    import importlib.util

    for package in ("kvformat", "kvsnap", "kvsnap.analysis", "kvsnap.capture"):
        spec = importlib.util.find_spec(package)
        folders = spec.submodule_search_locations if spec is not None else None
        for folder in folders or []:
            compileall.compile_dir(folder, quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/kvsnap-cli-bench")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="cpu,mlx")
    args = parser.parse_args()
    print(blas_line())
    byte_compile()
    directory = Path(args.dir)
    print("| file | backend | fresh `kvsnap stats -o`: median (range) | read | read / cmd | peak RSS | PSS |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, path in files(directory).items():
        read = read_seconds(path)
        for backend in args.backends.split(","):
            times, rss, tree = [], 0, 0
            for _ in range(args.runs):
                out = directory / "out.parquet"
                command = [sys.executable, "-c", COMMAND, "stats", str(path), "-o", str(out), "--force"]
                command += ["--backend", backend]
                start = time.perf_counter()
                try:
                    sampled = run_sampled(command)
                except subprocess.CalledProcessError as error:
                    print(f"| {label} | {backend} | failed: {error.stderr.strip()[-200:]} | | | | |")
                    break
                times.append(time.perf_counter() - start)
                rss, tree = max(rss, sampled.largest_rss), max(tree, sampled.tree_pss)
            if not times:
                continue
            median = statistics.median(times)
            print(
                f"| {label} | {backend} | {median:.2f} s ({min(times):.2f}-{max(times):.2f}) | {read:.3f} s "
                f"| {read / median:.3f}x | {rss / 2**20:.0f} MiB | {tree / 2**20:.0f} MiB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
