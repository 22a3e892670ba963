"""The ``attention`` statistics group against the ``spectrum`` group on one file with queries
(the target: the first costs no more than the second), as a user runs them: each in a
fresh process, defaults. Both orders are run, since whichever goes first in a process also pays
the imports and the compiled kernels' loading: ``first`` is a fresh process's only call, ``then``
the same group after the other one in that process.

    python -m benchmarks.attention_group_bench FILE [--runs 5] [--arrow]

It also times, in the same run, the products neither group can skip, bare numpy on float32
arrays already in memory in their fastest form (BLAS on every core, the query heads of a KV head
stacked, the weights in one reused buffer): attention's ``q k^T`` and ``w v`` for every query
head (its floor: every score needs the first, ``streaming_error`` the second) and spectrum's
Gram matrices ``k^T k``, ``v^T v`` for every KV head.

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
path, order, arrow = sys.argv[1], sys.argv[2].split(","), sys.argv[3] == "arrow"
if arrow:  # what `kvsnap stats FILE --stats G` computes: Arrow tables, no polars
    from kvsnap.analysis.attention.head_importance import attention_table
    from kvsnap.analysis.engine.tables import file_tables
    calls = {
        "attention": lambda: attention_table(path),
        "spectrum": lambda: list(file_tables([path], stats="spectrum")),
    }
else:
    calls = {
        "attention": lambda: kvsnap.attention_stats(path),
        "spectrum": lambda: kvsnap.head_stats([path], stats="spectrum"),
    }
for name in order:
    start = time.perf_counter()
    calls[name]()
    print(name, time.perf_counter() - start)
"""

_FLOOR = """
import sys, time
import numpy as np
import kvformat
attention = gram = 0.0
weights = np.empty(0, np.float32)  # reused: fresh pages for every product would cost faults
with kvformat.open(sys.argv[1]) as snap:
    for layer, spec in enumerate(snap.layers):
        if spec.queries is None:
            continue
        heads = {}
        for kv in sorted(set(spec.queries.kv_heads)):
            head = snap.head(layer, kv)
            heads[kv] = (np.asarray(head.k, np.float32), np.asarray(head.v, np.float32))
        queries = [np.asarray(snap.queries(layer, h).q, np.float32) for h in range(spec.queries.num_heads)]
        stacked = {  # the query heads of one KV head as one matrix: the largest, fastest products
            kv: np.concatenate([q for h, q in enumerate(queries) if spec.queries.kv_heads[h] == kv])
            for kv in heads
        }
        start = time.perf_counter()
        for kv, q in stacked.items():
            k, v = heads[kv]
            if weights.size < q.shape[0] * k.shape[0]:
                weights = np.empty(q.shape[0] * k.shape[0], np.float32)
            w = weights[: q.shape[0] * k.shape[0]].reshape(q.shape[0], k.shape[0])
            np.matmul(np.matmul(q, k.T, out=w), v)
        attention += time.perf_counter() - start
        start = time.perf_counter()
        for k, v in heads.values():
            k.T @ k, v.T @ v
        gram += time.perf_counter() - start
print(attention, gram)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--arrow",
        action="store_true",
        help="the groups as `kvsnap stats` computes them (Arrow tables, no polars) instead of the "
        "Python API's DataFrames (`attention_stats`, `head_stats`)",
    )
    args = parser.parse_args()
    print(blas_line())
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.runs):
        for order in (("attention", "spectrum"), ("spectrum", "attention")):
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, args.file, ",".join(order), "arrow" if args.arrow else "api"],
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
    floors = [
        [
            float(x)
            for x in subprocess.run(
                [sys.executable, "-c", _FLOOR, args.file], check=True, capture_output=True, text=True
            ).stdout.split()
        ]
        for _ in range(args.runs)
    ]
    products, grams = min(f[0] for f in floors), min(f[1] for f in floors)
    spectrum = statistics.median(times[("spectrum", "then")])
    print(
        f"bare products on arrays in memory (fastest of {args.runs}): attention's q k^T + w v "
        f"{products:.3f} s = {products / spectrum:.2f}x spectrum's whole group after the other "
        f"({spectrum:.2f} s); spectrum's k^T k + v^T v {grams:.3f} s"
    )


if __name__ == "__main__":
    main()
