"""The CPU backend's kernels, C (`analysis.kernels.native`, the default where the install built it) against
the numpy reference that runs without them (``KVSNAP_KERNEL=numpy``), in the same run, each in
fresh processes:

- **start**: a fresh interpreter importing the kernels and running each once on a few rows, what
  the fork server of the CPU workers does before it forks the first one (`warm_kernels`) and what
  a one-process pass pays before its first rows (loading the shared library, or nothing);
- **steady**: the best of 15 warm calls, one thread: `HeadAccumulator.add` of every group over
  8192 x 128 float32 rows (the fused kernel plus the Gram matrix's BLAS), the eigenvalues of one
  128 x 128 covariance and of a layer's 16 (the C solver takes four at a time), and 1 Mi float16
  values to float32; with the rows' size over the time,
  against the machine's own ``memcpy`` of the same bytes (numpy's ``copyto``).

    python -m benchmarks.kernel_bench [--runs 5]

Each row: median and range over ``--runs`` processes per mode, modes alternated (C, numpy, C, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = r"""
import json, time
t0 = time.perf_counter()
import numpy as np
t1 = time.perf_counter()
import kvsnap.analysis.engine.warm_kernels  # imports the kernels and runs each once
t2 = time.perf_counter()
import sys
import kvsnap.analysis.kernels.native
from kvsnap.analysis.kernels import eigen, halves
from kvsnap.analysis.engine.accumulator import HeadAccumulator
from kvsnap.analysis.stats.catalogue import ALL
from kvsnap.analysis.stats.rope import Rope

def best(f, runs=15):
    times = []
    for _ in range(runs):
        start = time.perf_counter(); f(); times.append(time.perf_counter() - start)
    return min(times)

rng = np.random.default_rng(0)
x = (rng.standard_normal((8192, 128)) * np.exp(rng.normal(0, 1, 128))).astype(np.float32)
positions = np.arange(8192)
rope = Rope(10000.0, 128, "half")
accumulate = lambda: HeadAccumulator(128, rope, ALL).add(x, positions)
gram = x[:2048].astype(np.float64).T @ x[:2048].astype(np.float64) / 2048
layer = np.stack([gram * (1.0 + 0.01 * i) + np.eye(128) * i for i in range(16)])
h = rng.standard_normal(1 << 20).astype(np.float16)
out = np.empty(h.size, np.float32)
copy = np.empty_like(x)
print(json.dumps({
    "numpy import": t1 - t0,
    "kernels start": t2 - t1,
    "compiled": kvsnap.analysis.kernels.native.AVAILABLE,
    "accumulate 8192x128": best(accumulate),
    "memcpy 8192x128 float32": best(lambda: np.copyto(copy, x)),
    "eigenvalues 128": best(lambda: eigen.eigenvalues(gram)),
    "eigenvalues, a layer's 16": best(lambda: eigen.eigenvalues_of(layer)),
    "float16 -> float32 1 Mi": best(lambda: halves.to_float32(h, out)),
}))
"""

MODES = ("compiled", "numpy")


def probe(mode: str) -> dict[str, float]:
    """One fresh process's figures with ``KVSNAP_KERNEL=mode``."""
    env = {**os.environ, "KVSNAP_KERNEL": mode}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per mode")
    args = parser.parse_args()
    from kvsnap.analysis.kernels import native

    if not native.AVAILABLE:
        raise SystemExit("the C kernels are not built here: pip install -e . (with a C compiler)")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.runs):
        for mode in MODES:
            results[mode].append(probe(mode))
    print(f"{'':28}{'C (default)':>30}{'numpy':>30}{'numpy / C':>12}")
    for key in results["compiled"][0]:
        if key == "compiled":
            print(f"{key:28}{results['compiled'][0][key]!s:>30}{results['numpy'][0][key]!s:>30}")
            continue
        cells, medians = [], []
        for mode in MODES:
            values = [run[key] * 1e3 for run in results[mode]]
            medians.append(statistics.median(values))
            cells.append(f"{medians[-1]:.3f} ms ({min(values):.3f}-{max(values):.3f})")
        print(f"{key:28}{cells[0]:>30}{cells[1]:>30}{medians[1] / medians[0]:>11.2f}x")
    c = statistics.median(run["accumulate 8192x128"] for run in results["compiled"])
    copy = statistics.median(run["memcpy 8192x128 float32"] for run in results["compiled"])
    print(f"accumulate: {8192 * 128 * 4 / c / 1e9:.2f} GB/s of float32 rows, {copy / c:.3f}x of a memcpy")


if __name__ == "__main__":
    main()
