"""How far the statistics can scale on this machine, apart from any pass: the accumulator's
throughput on in-memory arrays over 1..N threads (the arithmetic's own ceiling, per statistic
group), and the read paths a pass can take over a file on 1..N threads (``pread`` into a reused
buffer, a memory map, a memory map whose pages are released after each 8 MiB as the pass
releases them), each with a CRC-32C of what it read.

    python -m benchmarks.probes.scaling_probe memory
    python -m benchmarks.probes.scaling_probe read FILE

BLAS is limited to one thread; each thread works on its own 64 MiB array (memory) or on
8 MiB ranges of the file handed out in order (read).
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvformat.checksum import crc32c

GROUPS = ["norms,channels", "quant", "spectrum", "norms,channels,rope,quant", "all"]
MIB = 1 << 20


def threads_up_to(n: int) -> list[int]:
    return sorted({t for t in (1, 2, 4, 8, 16, 32, 64) if t <= n} | {n})


def memory(threads: list[int]) -> None:
    from threadpoolctl import threadpool_limits

    from kvsnap.analysis.engine.accumulator import HeadAccumulator
    from kvsnap.analysis.stats.catalogue import stat_groups
    from kvsnap.analysis.stats.rope import Rope

    rows = 64 * MIB // 512
    generators = [np.random.default_rng(t) for t in range(max(threads))]
    arrays = [g.standard_normal((rows, 128), dtype=np.float32) * 2 for g in generators]
    positions = np.arange(rows)
    rope = Rope(10000.0, 128, "half")

    def work(t: int, groups: frozenset[str], repeats: int) -> None:
        for _ in range(repeats):
            HeadAccumulator(128, rope, groups).add(arrays[t], positions)

    with threadpool_limits(1):
        for name in GROUPS:
            groups = stat_groups(name)
            work(0, groups, 1)
            line = []
            for n in threads:
                with ThreadPoolExecutor(n) as pool:
                    start = time.perf_counter()
                    list(pool.map(lambda t, g=groups: work(t, g, 4), range(n)))
                    seconds = time.perf_counter() - start
                line.append(f"{n} threads {n * 4 * 64 * MIB / seconds / 1e9:5.2f}")
            print(f"{name:28s} GB/s in memory: " + "  ".join(line), flush=True)


def read(path: str, threads: list[int]) -> None:
    size = os.path.getsize(path)
    ranges = [(offset, min(8 * MIB, size - offset)) for offset in range(0, size, 8 * MIB)]
    descriptor = os.open(path, os.O_RDONLY)

    def run(mode: str, n: int) -> float:
        mapped = mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
        base = memoryview(mapped)
        local = threading.local()

        def one(item: tuple[int, int]) -> None:
            offset, length = item
            if mode == "pread":
                buffer = getattr(local, "buffer", None)
                if buffer is None:
                    buffer = local.buffer = bytearray(8 * MIB)
                view = memoryview(buffer)[:length]
                os.preadv(descriptor, [view], offset)
                crc32c(view)
                return
            view = base[offset : offset + length]
            crc32c(view)
            view.release()
            if mode == "map, pages released":
                start = offset // mmap.PAGESIZE * mmap.PAGESIZE
                end = (offset + length) // mmap.PAGESIZE * mmap.PAGESIZE
                mapped.madvise(mmap.MADV_DONTNEED, start, end - start)

        start = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, ranges))
        seconds = time.perf_counter() - start
        base.release()
        mapped.close()
        return size / seconds / 1e9

    for mode in ("pread", "map", "map, pages released"):
        line = "  ".join(f"{n} threads {run(mode, n):5.2f}" for n in threads)
        print(f"{mode:22s} GB/s: {line}", flush=True)


def main() -> None:
    from kvsnap.analysis.engine.parallel import cores

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["memory", "read"])
    parser.add_argument("file", nargs="?")
    parser.add_argument("--threads", type=int, default=cores(), help="the most threads (default: every core)")
    args = parser.parse_args()
    threads = threads_up_to(args.threads)
    if args.what == "memory":
        memory(threads)
    elif args.file is None:
        parser.error("read needs a FILE")
    else:
        read(args.file, threads)


if __name__ == "__main__":
    main()
