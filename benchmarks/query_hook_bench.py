"""What `--queries` adds to every attention call: the query recorder's wrapper around mlx-lm's
``scaled_dot_product_attention``, against a pass-through wrapper (the floor any hook pays: one
more Python call with the same arguments), in the same run.

A 36-layer model's decode calls (Qwen3-8B's shapes: 32 query heads, 8 KV heads, head_dim 128,
bf16) on 36 live `KVCache` objects, each call's keys a fresh slice of its cache as mlx-lm hands
them, a snapshot's ``take`` every 16 steps; the attention itself is not run (both wrappers call
a no-op), so what is timed is the bookkeeping alone, in microseconds per call.

    python -m benchmarks.query_hook_bench [--steps 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvsnap.capture.queries import QueryRecorder

LAYERS = 36


def per_call(
    wrapper: Callable[..., Any], caches: list[KVCache], take: Callable[[], Any], steps: int
) -> float:
    """Seconds per attention call over ``steps`` decode steps of every layer."""
    queries = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    mx.eval(queries)
    start = time.perf_counter()
    for step in range(steps):
        for cache in caches:
            cache.offset += 1  # as update_and_fetch moves it
            keys = cache.keys[:, :, : cache.offset]
            wrapper(queries, keys, keys, cache=cache, scale=0.088, mask=None)
        if step % 16 == 15:
            take()
    return (time.perf_counter() - start) / (steps * len(caches))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}")

    def fresh() -> list[KVCache]:
        caches = [KVCache() for _ in range(LAYERS)]
        rows = mx.zeros((1, 8, 16, 128), mx.bfloat16)
        for cache in caches:
            cache.update_and_fetch(rows, rows)
        mx.eval([cache.state for cache in caches])
        return caches

    def attention(*args: Any, **kwargs: Any) -> None:
        return None

    def passthrough(*args: Any, **kwargs: Any) -> None:
        return attention(*args, **kwargs)

    recorder_s, floor_s = [], []
    for _ in range(args.rounds):  # alternated, so drift falls on both
        caches = fresh()
        recorder = QueryRecorder(caches, 0, None)
        recorder_s.append(per_call(recorder._wrap(attention), caches, recorder.take, args.steps))
        caches = fresh()
        floor_s.append(per_call(passthrough, caches, lambda: None, args.steps))
    recorder_us, floor_us = 1e6 * statistics.median(recorder_s), 1e6 * statistics.median(floor_s)
    print(
        f"query recorder {recorder_us:.2f} us per attention call "
        f"(rounds {1e6 * min(recorder_s):.2f}-{1e6 * max(recorder_s):.2f}); pass-through wrapper "
        f"{floor_us:.2f} us (the keys' slice included in both); the recorder's own bookkeeping "
        f"{recorder_us - floor_us:.2f} us, {recorder_us / floor_us:.2f}x the floor"
    )


if __name__ == "__main__":
    main()
