"""The ``attention`` statistics group against the ``spectrum`` group on one file with queries
(issue 44's target: the first costs no more than the second), as a user runs them: each in a
fresh process, defaults. Both orders are run, since whichever goes first in a process also pays
the imports and the compiled kernels' loading: ``first`` is a fresh process's only call, ``then``
the same group after the other one in that process.

    python -m benchmarks.attention_group_bench FILE [--runs 5]

FILE: a capture with queries, e.g. ``python -m benchmarks.needle --filler 110 --queries
window:64`` (about 7,800 tokens of SmolLM2-135M) writes ``out/needle/needle.kv``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from benchmarks.timing import blas_line

_CHILD = """
import sys, time
import kvsnap
path, order = sys.argv[1], sys.argv[2].split(",")
calls = {
    "attention": lambda: kvsnap.attention_stats(path),
    "spectrum": lambda: kvsnap.head_stats([path], stats="spectrum"),
}
for name in order:
    start = time.perf_counter()
    calls[name]()
    print(name, time.perf_counter() - start)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(blas_line())
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.runs):
        for order in (("attention", "spectrum"), ("spectrum", "attention")):
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, args.file, ",".join(order)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
            for place, (name, seconds) in zip(
                ("first", "then"), zip(out[::2], out[1::2], strict=True), strict=True
            ):
                times.setdefault((name, place), []).append(float(seconds))
    print("| group | first in a fresh process | after the other group |")
    print("|---|---:|---:|")
    for name in ("attention", "spectrum"):
        cells = []
        for place in ("first", "then"):
            found = times[(name, place)]
            cells.append(f"{statistics.median(found):.2f} s ({min(found):.2f}-{max(found):.2f})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    for place in ("first", "then"):
        ratio = statistics.median(times[("attention", place)]) / statistics.median(times[("spectrum", place)])
        print(f"attention / spectrum, {place}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
