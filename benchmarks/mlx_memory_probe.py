"""What holds a process's host memory (resident set) when it computes with mlx: the resident
set by kind (anonymous, file-backed) and mlx's own counters after each step: mlx started, large
arrays on the device, a few kernels, then the mlx backend's compiled per-piece function
(`mlx_kernel._piece_function`, batched: 16 bfloat16 pieces of `accumulator.PIECE` rows x 128)
compiled and run, and run again with mlx's buffer cache cleared and limited to 0.

    python -m benchmarks.mlx_memory_probe

On the H200 machine (session 17) the device's arrays did not show in the resident set (1 GiB of
``mx.zeros``: +0 MiB); the kernels mlx compiled at their first use did (the per-piece function:
+574 MiB anonymous), and neither clearing nor limiting mlx's cache gave any back.
"""

from __future__ import annotations

import json

import numpy as np


def resident(label: str) -> None:
    """Print the resident set by kind (MiB) and mlx's active and cached memory."""
    import mlx.core as mx

    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "VmRSS")):
                name, value = line.split(":")
                parts[name] = int(value.split()[0]) // 1024
    active, cached = mx.get_active_memory() >> 20, mx.get_cache_memory() >> 20
    print(json.dumps({"step": label, **parts, "mlx_active": active, "mlx_cache": cached}), flush=True)


def main() -> None:
    import mlx.core as mx

    from kvsnap.analysis import mlx_kernel
    from kvsnap.analysis.accumulator import PIECE

    resident("imported")
    mx.eval(mx.ones((16,)) + 1)
    resident("mlx started (one small op)")
    a = mx.zeros((1 << 28,))
    mx.eval(a)
    resident("1 GiB of zeros on the device")
    b = a * 2 + 1
    mx.eval(b)
    resident("1 GiB more, computed")
    del a, b
    mx.clear_cache()
    resident("freed, cache cleared")
    x = mx.random.normal((16, PIECE, 128))
    mx.eval(x)
    for _ in range(3):
        mx.eval((mx.sort(x * 1.0, axis=1) + mx.exp(x)).sum())
    resident("sort, exp, sum on 64 MiB")
    function = mlx_kernel._piece_function(True, True, True, True, True, True, batched=True)
    bins = mx.array(np.stack([mlx_kernel._piece_bins(np.arange(PIECE))] * 16))
    pieces = x.astype(mx.bfloat16)
    mx.eval(pieces, bins)
    mx.eval(function(pieces, bins))
    resident("per-piece function compiled and run (16 bfloat16 pieces)")
    for _ in range(5):
        mx.eval(function(pieces, bins))
    resident("run 5 more times")
    mx.clear_cache()
    mx.set_cache_limit(0)
    for _ in range(5):
        mx.eval(function(pieces, bins))
    resident("cache cleared and limited to 0, run 5 more times")


if __name__ == "__main__":
    main()
