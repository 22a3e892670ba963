"""The CPU backend's pass over one file on one core, with numba compiling its kernels for each
named target CPU (``NUMBA_CPU_NAME``; ``default``: the host as llvmlite names it), each in a fresh
process with an empty kernel cache: compiled once, then the fastest of three passes. It asks
whether a host's default target is the fast one (a CPU that LLVM does not know could get a
baseline target and lose its vector units).

    python -m benchmarks.probes.numba_target_probe FILE [--targets default,x86-64-v3,skylake-avx512]

FILE is written (a Qwen3-8B-shaped bfloat16 file of 1024 tokens, 151 MB) when it does not exist.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import sys, time
import llvmlite.binding as ll
import numba
from kvsnap.analysis.stats import stats_for_file
path = sys.argv[1]
for _ in stats_for_file(path, jobs=1):  # compiles the kernels for this target
    pass
times = []
for _ in range(3):
    start = time.perf_counter()
    for _ in stats_for_file(path, jobs=1):
        pass
    times.append(time.perf_counter() - start)
runs = ", ".join(f"{t:.3f}" for t in times)
target = numba.config.CPU_NAME or "host"
print(f"host {ll.get_host_cpu_name()}, target {target}: one file, one core {min(times):.3f} s ({runs})")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--targets", default="default,x86-64-v3,skylake-avx512")
    args = parser.parse_args()
    path = Path(args.file)
    if not path.exists():
        from benchmarks.analysis_bench import SHAPES, write

        layers, heads, dim, dtype = SHAPES["qwen3-8b-bf16"]
        write(path, layers, heads, dim, 1024, dtype, "raw")
    for target in args.targets.split(","):
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_NAME"}
        env["OPENBLAS_NUM_THREADS"] = "1"
        if target != "default":
            env["NUMBA_CPU_NAME"] = target
        env["KVSNAP_CACHE"] = env["NUMBA_CACHE_DIR"] = tempfile.mkdtemp()
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path)], env=env, capture_output=True, text=True, check=False
        )
        print(target, done.stdout.strip() or done.stderr[-600:], flush=True)


if __name__ == "__main__":
    main()
