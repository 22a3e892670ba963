"""The generating thread's own work in one series snapshot, split, on whatever backend mlx runs:
`CacheTracker.read` (the walk over the layers and the slices of their new rows), its `end`, and
`Transfer` (the join on the device and the asynchronous evaluation), on a synthetic cache of
``--layers`` plain `KVCache` layers (SmolLM2-135M: 30 layers, 3 KV heads of 64, float16) that
gains 16 positions between snapshots. Medians over ``--snapshots``; the device is synchronized
after each snapshot, Python's garbage collected and the previous snapshot's arrays freed
before the next, outside the timed calls.

    python -m benchmarks.probes.take_probe [--layers 30] [--heads 3] [--dim 64] [--snapshots 300]
        [--dtype float16] [--tight]

These are cold figures, as in generation: each snapshot's calls come after the model's steps
touched other memory, and here they take 2-3x what the same calls take repeated in a tight loop
(30 layers on this machine's CPU build: `read` ~300 us against ~80-140 us). They vary by +-30%
between runs here, so an A/B of a few tens of microseconds needs the tight loop (``--tight``:
the layers' offsets are moved on by 16 without writing rows, nothing collected or held between
snapshots); it was run for each version from its own
source tree, alternated (Qwen3-8B shape: ``--layers 36 --heads 8 --dim 128 --dtype bfloat16``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvsnap.capture.background import Transfer
from kvsnap.capture.deltas import CacheTracker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--snapshots", type=int, default=300)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--tight", action="store_true", help="move offsets on, write no rows")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    rows = mx.zeros((1, args.heads, 128, args.dim), dtype)
    step = mx.zeros((1, args.heads, 1, args.dim), dtype)
    caches = []
    for _ in range(args.layers):
        cache = KVCache()
        cache.update_and_fetch(rows, rows)
        caches.append(cache)
    mx.eval([(cache.keys, cache.values) for cache in caches])
    tracker = CacheTracker()
    tracker.read(caches)
    times: dict[str, list[float]] = {"read": [], "end": [], "Transfer": []}
    held: list[object] = []
    for _ in range(args.snapshots):
        for cache in caches:  # positions written by the model between snapshots
            for _ in range(args.every):
                if not args.tight or cache.offset + 1 > cache.keys.shape[2]:
                    cache.update_and_fetch(step, step)  # (tight: only to grow the buffer)
                else:
                    cache.offset += 1
        mx.eval([(cache.keys, cache.values) for cache in caches])
        if not args.tight:
            held.clear()  # the previous snapshot's arrays are freed here, not in a timed call
            gc.collect()  # the model's steps leave garbage; a collection in a timed call is noise
        gc.disable()
        start = time.perf_counter()
        deltas = tracker.read(caches)
        times["read"].append(time.perf_counter() - start)
        start = time.perf_counter()
        tracker.end()
        times["end"].append(time.perf_counter() - start)
        arrays = [array for delta in deltas for array in (*delta.keys, *delta.values)]
        start = time.perf_counter()
        transfer = Transfer(arrays)
        times["Transfer"].append(time.perf_counter() - start)
        gc.enable()
        mx.synchronize()
        if not args.tight:
            held += [deltas, arrays, transfer]
    times["read + Transfer"] = [a + b for a, b in zip(times["read"], times["Transfer"], strict=True)]
    cells = [f"{name} {_spread(values)} us" for name, values in times.items()]
    print(f"{mx.default_device()}, {args.layers} layers: " + ", ".join(cells))


def _spread(values: list[float]) -> str:
    """Median (quartiles) in microseconds."""
    low, median, high = statistics.quantiles([v * 1e6 for v in values], n=4)
    return f"{median:.0f} ({low:.0f}-{high:.0f})"


if __name__ == "__main__":
    main()
