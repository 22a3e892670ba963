"""`kvsnap simulate` against `kvsnap stats --stats attention` on the same file, in the same run:
the what-ifs of every method the file's queries allow at the default 3 budgets, against the one
pass that scores every head's attention. Each a fresh process with default settings, alternated;
prints each one's wall-clock times, the peak private memory of its processes together (the
command and its workers) and the ratio of the medians.

    python -m benchmarks.simulate_bench [FILE] [--runs 3]
    python -m benchmarks.simulate_bench out/seed.kv --seed-sized --runs 1

FILE defaults to ``out/needle/needle.kv`` (``python -m benchmarks.needle`` writes it: SmolLM2-135M,
a 906-position capture with every query).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import memory


def timed(argv: list[str]) -> tuple[float, float]:
    """Wall-clock seconds of one fresh process running ``argv``, and the peak anonymous resident
    MiB of it and its worker processes together (sampled every 50 ms)."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak = [0.0]

    def sample() -> None:
        while child.poll() is None:
            pids = memory.descendants(child.pid)
            peak[0] = max(peak[0], sum(memory.anonymous(pid) for pid in pids) / 2**20)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    child.wait()
    seconds = time.perf_counter() - start
    sampler.join()
    if child.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({child.returncode})")
    return seconds, peak[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default="out/needle/needle.kv")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--seed-sized",
        action="store_true",
        help="FILE is the 8.6 GB seed-sized capture (8,192 tokens, 32 layers of 32 KV heads, float32, "
        "queries at the last 64 positions), written there first if missing",
    )
    args = parser.parse_args()
    if args.seed_sized and not Path(args.file).exists():
        from benchmarks.viewer_bench import synthetic

        synthetic(Path(args.file), 8192, 32, kv_heads=32, dtype="float32")
    if not Path(args.file).exists():
        raise SystemExit(f"{args.file} does not exist: python -m benchmarks.needle writes it")
    folder = Path(tempfile.mkdtemp(prefix="kvsnap-simulate-bench-"))
    kvsnap = [sys.executable, "-m", "kvsnap"]
    commands = {
        "stats --stats attention": [*kvsnap, "stats", args.file, "--stats", "attention",
                                    "-o", str(folder / "attention.parquet"), "--force"],
        "simulate (every method, 3 budgets)": [*kvsnap, "simulate", args.file,
                                               "-o", str(folder / "simulate.parquet"), "--force"],
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in commands}
    peaks: dict[str, float] = {}
    for _ in range(args.runs):
        for name, argv in commands.items():
            seconds, peak = timed(argv)
            times[name].append(seconds)
            peaks[name] = max(peaks.get(name, 0.0), peak)
    for name, values in times.items():
        spread = f"{min(values):.2f}-{max(values):.2f}"
        median = statistics.median(values)
        print(f"{name}: median {median:.2f} s ({spread}), peak {peaks[name]:.0f} MiB private")
    first, second = (statistics.median(values) for values in times.values())
    print(f"simulate / attention statistics: {second / first:.2f}x")


if __name__ == "__main__":
    main()
