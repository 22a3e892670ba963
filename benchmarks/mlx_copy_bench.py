"""How fast host rows reach mlx's device: ``mx.array`` of each piece (what `analysis.mlx_backend`
did at first) against copying into the memory of an existing mlx array through its
buffer (``np.copyto`` into ``np.asarray(memoryview(array))``, on 1..N threads), each followed by a
small device reduction that reads every byte, in a pipeline of two batches like the pass.

    python -m benchmarks.mlx_copy_bench [--gib 2] [--batch-mib 32]
        [--placements fault,host,prefetch,mostly]

``--placements``: the pass's own `Staging` buffers under each CUDA managed-memory placement
(`analysis.unified_memory`; ``KVSNAP_MLX_STAGING``), the host's copy and the device's read timed
apart. Prints GB/s per variant and checks that every variant's device results equal numpy's (a buffer
written behind mlx's back must be what the device reads).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--batch-mib", type=int, default=32)
    parser.add_argument("--threads", default="1,4,8,16")
    parser.add_argument("--placements", default="", help="e.g. fault,host,prefetch,mostly")
    args = parser.parse_args()
    rows_per_batch = (args.batch_mib << 20) // (128 * 4)
    batches = int(args.gib * (1 << 30)) // (args.batch_mib << 20)
    source = np.random.default_rng(0).standard_normal((batches, rows_per_batch, 128), dtype=np.float32)
    expected = np.square(source, dtype=np.float64).sum(axis=1)  # (batches, 128)
    reduce = mx.compile(lambda x: mx.square(x).sum(axis=0))
    print(f"device {mx.default_device()}, {batches} batches of {args.batch_mib} MiB")

    def check(name: str, results: list[np.ndarray], seconds: float) -> None:
        got = np.stack(results)
        ok = np.allclose(got, expected, rtol=1e-4)
        rate = source.nbytes / seconds / 1e9
        print(f"{name:40s} {rate:6.2f} GB/s  ({seconds:.3f} s)  equal to numpy: {ok}")

    def run_mx_array() -> None:
        results: list[np.ndarray] = []
        previous = None
        start = time.perf_counter()
        for i in range(batches):
            out = reduce(mx.array(source[i]))
            mx.async_eval(out)
            if previous is not None:
                results.append(np.array(previous))
            previous = out
        results.append(np.array(previous))
        check("mx.array per batch", results, time.perf_counter() - start)

    def run_buffers(threads: int, fresh: bool) -> None:
        pool = ThreadPoolExecutor(threads)
        buffers = [mx.zeros((rows_per_batch, 128), dtype=mx.float32) for _ in range(2)]
        mx.eval(buffers)
        results: list[np.ndarray] = []
        outs: list[mx.array | None] = [None, None]
        start = time.perf_counter()
        for i in range(batches):
            slot = i % 2
            if outs[slot] is not None:  # the device is done reading this buffer
                results.append(np.array(outs[slot]))
            if fresh:
                buffers[slot] = mx.zeros((rows_per_batch, 128), dtype=mx.float32)
                mx.eval(buffers[slot])
            view = np.asarray(memoryview(buffers[slot]))
            step = -(-rows_per_batch // threads)
            parts = [(view[r : r + step], source[i, r : r + step]) for r in range(0, rows_per_batch, step)]
            list(pool.map(lambda part: np.copyto(*part), parts))
            outs[slot] = reduce(buffers[slot])
            mx.async_eval(outs[slot])
        for j in range(batches, batches + 2):
            out = outs[j % 2]
            if out is not None:
                results.append(np.array(out))
        pool.shutdown()
        name = f"copy into buffer, {threads} threads{', fresh' if fresh else ''}"
        check(name, results, time.perf_counter() - start)

    def run_staging(placement: str) -> None:
        from kvsnap.analysis.kernels.mlx_staging import Staging

        staging = Staging(4, placement=placement)
        held: list[list[mx.array]] = [[], []]
        results: list[np.ndarray] = []
        copy_seconds = device_seconds = 0.0
        start = time.perf_counter()
        for i in range(batches):
            slot = i % 2
            if held[slot]:  # one batch on the device while the next is copied, as in a pass
                tick = time.perf_counter()
                results.append(np.array(held[slot][1]))
                device_seconds += time.perf_counter() - tick
                staging.give_back([held[slot][0]])
            tick = time.perf_counter()
            buffer, stacked = staging.fill([source[i]])
            copy_seconds += time.perf_counter() - tick
            out = reduce(stacked[0])
            mx.async_eval(out)
            held[slot] = [buffer, out]
        for j in range(batches, batches + 2):
            if held[j % 2]:
                results.append(np.array(held[j % 2][1]))
        seconds = time.perf_counter() - start
        managed = sum(staging.managed.values())
        staging.close()
        name = f"staging, placement {placement} ({managed} managed)"
        check(name, results, seconds)
        print(f"{'':40s} copy {copy_seconds:.3f} s, device wait {device_seconds:.3f} s")

    for placement in filter(None, args.placements.split(",")):
        run_staging(placement)
        run_staging(placement)
        run_staging(placement)
    run_mx_array()
    run_mx_array()
    for threads in (int(t) for t in args.threads.split(",")):
        run_buffers(threads, fresh=False)
    run_buffers(8, fresh=True)
    start = time.perf_counter()
    np.copyto(np.empty_like(source), source)
    rate = source.nbytes / (time.perf_counter() - start) / 1e9
    print(f"{'host memcpy, 1 thread (the floor)':40s} {rate:6.2f} GB/s")


if __name__ == "__main__":
    main()
