"""What holds a process's host memory (resident set) when it computes with mlx.

    python -m benchmarks.mlx_memory_bench                      # steps, one process
    python -m benchmarks.mlx_memory_bench --pass FILE [--jobs N] [--passes 2]
    python -m benchmarks.mlx_memory_bench --operations
    python -m benchmarks.mlx_memory_bench --selections          # KVSNAP_CUDA_GRAM=0: with cuBLAS
    python -m benchmarks.mlx_memory_bench --modules 40

``--selections``: the per-piece function of each group selection (`SELECTIONS`), alone in a
fresh process: what it adds to a started process, and a call's time. ``--modules N``: the
resident set as one process loads N distinct kernels that mlx compiles (run it twice: the
second run finds them in mlx's PTX cache).

``--operations``: each mlx operation the backend uses, alone in a fresh process, on 16 pieces of
`arrays.PIECE` rows x 128: what its first use adds to the resident set and glibc's heap
(the kernels' code the first use loads) and to the time.

Steps (one process): the resident set by kind (anonymous, file-backed), glibc's heap (in use and
free-but-kept, ``mallinfo2``) and mlx's own counters after each step: mlx started, large arrays on
the device, a few kernels, the mlx backend's compiled per-piece function (`mlx_backend.piece_function`,
batched: 16 bfloat16 pieces of `arrays.PIECE` rows x 128) compiled and run, run again with
mlx's buffer cache cleared and limited to 0, then ``malloc_trim(0)`` (glibc hands its free pages
back). Then the largest mappings by resident size (``/proc/self/smaps``, grouped by file; anonymous
memory as ``[anon]``).

``--pass FILE``: `stats_for_file` over FILE on mlx with ``--jobs`` workers (worker processes where
`mlx_sizing.processes` gives more than one), ``--passes`` times, then for this process, its
helpers and every worker: resident and proportional set, peak resident set (``VmHWM``, and
the largest of samples taken every 20 ms during the passes: on a 16-core H200 host, sampled
runs saw mlx workers ~50 MiB above the ``VmHWM`` of another run), private dirty and anonymous
memory (``smaps_rollup``); a summary (the largest worker's peaks, the workers' proportional
sets summed) and the largest mappings of the largest worker.

On a 16-core H200 host the device's arrays did not show in the resident set (1
GiB of ``mx.zeros``: +0 MiB). The kernels did, as code loaded at their first use: ~760 MiB of
glibc's heap in use once the per-piece function ran, whether mlx compiled the kernels or found
them in its PTX cache. Neither clearing nor limiting mlx's cache gave any back, and
``malloc_trim`` gave back only what the compiler had freed (the benchmarks in `benchmarks/`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MIB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks"),
            *("uordblks", "fordblks", "keepcost"),
        )
    ]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


def heap() -> dict[str, int]:
    """glibc's heap, MiB: ``heap_used`` (allocated), ``heap_free`` (freed, still kept),
    ``mmapped`` (large blocks, mapped on their own)."""
    libc = _libc()
    if libc is None:
        return {}
    info = libc.mallinfo2()
    return {
        "heap_used": info.uordblks // MIB,
        "heap_free": info.fordblks // MIB,
        "mmapped": info.hblkhd // MIB,
    }


def trim() -> None:
    """Hand glibc's free heap pages back to the system."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, ``RssShmem`` of ``pid``, MiB."""
    parts = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM")):
                name, value = line.split(":")
                parts[name] = int(value.split()[0]) // 1024
    return parts


def rollup(pid: int | str = "self") -> dict[str, int]:
    """``smaps_rollup`` of ``pid``: Rss, Pss, Private_Dirty, Shared_Clean, Shared_Dirty, Anonymous, MiB."""
    wanted = ("Rss", "Pss", "Private_Dirty", "Private_Clean", "Shared_Clean", "Shared_Dirty", "Anonymous")
    parts = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in wanted:
                parts[name] = int(value.split()[0]) // 1024
    return parts


_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")


def largest_mappings(pid: int | str = "self", count: int = 12) -> list[tuple[str, int, int]]:
    """The ``count`` largest mappings of ``pid`` by resident size, grouped by name (file name,
    ``[heap]``, ``[anon]``): ``(name, rss MiB, private dirty MiB)``."""
    sizes: dict[str, list[int]] = {}
    name = "[anon]"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            match = _HEADER.match(line)
            if match:
                path = match.group(1).strip()
                name = os.path.basename(path) if path.startswith("/") else (path or "[anon]")
                sizes.setdefault(name, [0, 0])
            elif line.startswith("Rss:"):
                sizes[name][0] += int(line.split()[1])
            elif line.startswith("Private_Dirty:"):
                sizes[name][1] += int(line.split()[1])
    ranked = sorted(sizes.items(), key=lambda item: -item[1][0])[:count]
    return [(name, rss // 1024, dirty // 1024) for name, (rss, dirty) in ranked]


def resident(label: str) -> None:
    """Print the resident set by kind, glibc's heap and mlx's active and cached memory (MiB)."""
    import mlx.core as mx

    active, cached = mx.get_active_memory() // MIB, mx.get_cache_memory() // MIB
    print(
        json.dumps({"step": label, **status(), **heap(), "mlx_active": active, "mlx_cache": cached}),
        flush=True,
    )


def steps() -> None:
    import mlx.core as mx

    from kvsnap.analysis.kernels import mlx as mlx_backend
    from kvsnap.analysis.kernels import mlx_fold
    from kvsnap.analysis.kernels.arrays import PIECE

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
    function = mlx_backend.piece_function(True, True, True, True, True, True, batched=True)
    bins = mx.array(np.stack([mlx_fold.piece_bins(np.arange(PIECE))] * 16))
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
    trim()
    resident("malloc_trim(0)")
    print(json.dumps({"largest mappings (name, rss, private dirty; MiB)": largest_mappings()}), flush=True)


def one_pass(path: str, jobs: int, passes: int) -> None:
    from benchmarks.memory import TreeSampler, descendants
    from kvsnap.analysis.engine import processes
    from kvsnap.analysis.engine.tables import stats_for_file

    with TreeSampler(os.getpid()) as sampler:
        for index in range(passes):
            began = time.perf_counter()
            rows = sum(t.num_rows for t in stats_for_file(path, stats="all", jobs=jobs, backend="mlx"))
            seconds = round(time.perf_counter() - began, 3)
            print(json.dumps({"pass": index, "rows": rows, "seconds": seconds}), flush=True)
    pids = descendants(os.getpid())
    parents, commands = {}, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                commands[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    shown: list[dict[str, Any]] = []
    for pid, command in commands.items():
        # CPU workers are forked from the fork server (and show its command line); mlx workers
        # are spawned by this process; the resource tracker is a helper
        if pid == os.getpid():
            role = "this process"
        elif "resource_tracker" in command or pid in parents.values():
            role = "helper"
        else:
            role = "worker"
        try:
            entry = {"pid": pid, "role": role, "command": command[:60], **status(pid)}
            entry["sampled peak"] = sampler.peaks.get(pid, 0) // MIB
            shown.append({**entry, **rollup(pid)})
        except OSError:
            continue
    for entry in shown:
        print(json.dumps(entry))
    workers = [entry for entry in shown if entry["role"] == "worker"] or shown[:1]
    print(json.dumps({"processes (mlx workers)": processes.worker_count(jobs, "mlx")}))
    largest = max(workers, key=lambda entry: entry["VmHWM"])
    summary = {
        "computing processes": len(workers),
        "largest peak resident set (VmHWM), MiB": largest["VmHWM"],
        "largest resident set sampled every 20 ms, MiB": max(entry["sampled peak"] for entry in workers),
        "largest resident set now, MiB": max(entry["VmRSS"] for entry in workers),
        "their proportional sets, summed, MiB": sum(entry["Pss"] for entry in workers),
    }
    print(json.dumps(summary))
    if largest["role"] == "worker":
        print(json.dumps({"largest worker": largest["pid"], "mappings": largest_mappings(largest["pid"])}))
    print(json.dumps({"this process": largest_mappings()}))


def _piece_function(mx: Any, x: Any) -> None:
    from kvsnap.analysis.kernels import mlx as mlx_backend
    from kvsnap.analysis.kernels import mlx_fold

    function = mlx_backend.piece_function(True, True, True, True, True, True, batched=True)
    bins = mx.array(np.stack([mlx_fold.piece_bins(np.arange(x.shape[1]))] * x.shape[0]))
    mx.eval(function(x.astype(mx.bfloat16), bins))


def _gram_product(x: Any) -> Any:
    from kvsnap.analysis.kernels import cuda_gram

    return cuda_gram.gram_product(x)


OPERATIONS: dict[str, Callable[[Any, Any], None]] = {
    "sum, max (reductions)": lambda mx, x: mx.eval(x.sum(axis=1), x.max(axis=1)),
    "elementwise (exp, abs, where)": lambda mx, x: mx.eval(mx.where(x > 0, mx.exp(x), mx.abs(x))),
    "compiled elementwise": lambda mx, x: mx.eval(mx.compile(lambda a: mx.sqrt(a * a + 1) * 2)(x)),
    "astype bfloat16": lambda mx, x: mx.eval(x.astype(mx.bfloat16)),
    "matmul float32": lambda mx, x: mx.eval(x[0].T @ x[0]),
    "sort": lambda mx, x: mx.eval(mx.sort(x, axis=1)),
    "sort along the last axis (the median's)": lambda mx, x: mx.eval(mx.sort(x[:, :, 0] * 1, axis=1)),
    "min along the last axis": lambda mx, x: mx.eval((x[:, :, 0] * 1).min(axis=1)),
    "topk": lambda mx, x: mx.eval(mx.topk(x[:, :, 0], 64, axis=1)),
    "Gram kernel (kvsnap's, CUDA)": lambda mx, x: mx.eval(_gram_product(x)),
    "take": lambda mx, x: mx.eval(mx.take(x[0, :, 0], mx.arange(100))),
    "scatter add": lambda mx, x: mx.eval(
        mx.zeros((256,), mx.int32).at[mx.arange(8192) % 256].add(mx.ones((8192,), mx.int32))
    ),
    "argmax": lambda mx, x: mx.eval(mx.argmax(x, axis=1)),
    "cumsum": lambda mx, x: mx.eval(mx.cumsum(x, axis=1)),
    "the per-piece function (batched, bfloat16)": _piece_function,
}


def operation(name: str) -> None:
    """Run one of `OPERATIONS` in this process; print what its first use cost."""
    import mlx.core as mx

    from kvsnap.analysis.kernels.arrays import PIECE

    x = mx.random.normal((16, PIECE, 128))
    mx.eval(x)
    mx.eval(x + 1)
    before = {**status(), **heap()}
    began = time.perf_counter()
    OPERATIONS[name](mx, x)
    seconds = time.perf_counter() - began
    after = {**status(), **heap()}
    added = {key: after[key] - before[key] for key in ("VmRSS", "RssAnon", "heap_used", "mmapped")}
    print(
        json.dumps({"operation": name, "first use, s": round(seconds, 3), "added MiB": added, "then": after})
    )


def _inputs(dtype: str, batch: int, seed: int = 0) -> tuple[Any, Any]:
    """``batch`` pieces of random rows (128 channels) on the device and their position bins."""
    import mlx.core as mx

    from kvsnap.analysis.kernels import mlx_fold
    from kvsnap.analysis.kernels.arrays import PIECE

    mx.random.seed(seed)
    x = mx.random.normal((batch, PIECE, 128)).astype(getattr(mx, dtype))
    bins = mx.array(np.stack([mlx_fold.piece_bins(np.arange(PIECE))] * batch))
    mx.eval(x, bins)
    return x, bins


SELECTIONS = {
    # (norms, channels, rope, mean, gram, quant), as `mlx_backend.piece_flags` gives them
    "all": (True, True, True, True, True, True),
    "norms": (True, False, False, False, False, False),
    "channels": (False, True, False, True, False, False),
    "spectrum": (False, False, False, True, True, False),
    "quant": (False, False, False, False, False, True),
    "square_sum_only": (False, False, False, False, False, False),
    "power sums (channel means)": (False, False, False, True, False, False),
    "rope": (False, False, True, True, False, False),
    "norms, channels": (True, True, False, True, False, False),
    "all but spectrum": (True, True, True, True, False, True),
}
"""Group selections of the per-piece function (`mlx_backend.piece_function`'s flags)."""


def selection(name: str) -> None:
    """The per-piece function of one of `SELECTIONS` in this process (batched: 16 bfloat16 pieces
    of `arrays.PIECE` rows x 128): what it adds to a started process, and a call's time."""
    import mlx.core as mx

    from kvsnap.analysis.kernels import mlx as mlx_backend

    flags = SELECTIONS[name]
    mx.eval(mx.ones((4,)) + 1)
    x, bins = _inputs("bfloat16", 16)
    before = status()["VmRSS"]
    function = mlx_backend.piece_function(*flags, batched=True)
    inputs = (x, bins) if flags[0] else (x,)
    began = time.perf_counter()
    mx.eval(function(*inputs))
    first = time.perf_counter() - began
    added = status()["VmRSS"] - before
    for _ in range(3):
        mx.eval(function(*inputs))
    began = time.perf_counter()
    for _ in range(10):
        mx.eval(function(*inputs))
    call = (time.perf_counter() - began) / 10
    print(
        json.dumps(
            {
                "selection": name,
                "added MiB": added,
                "resident MiB": before + added,
                "first call, s": round(first, 2),
                "call, ms": round(call * 1e3, 2),
                "Gram product": "none"
                if not flags[4]
                else "kvsnap's CUDA kernel"
                if any(key[-1] for key in mlx_backend._COMPILED)  # the key's ``own_gram``
                else "mlx's matmul",
            }
        ),
        flush=True,
    )


def modules(count: int) -> None:
    """Resident set as this process loads ``count`` distinct kernels that mlx compiles (one
    compiled elementwise function each; run twice: the second run finds them cached)."""
    import mlx.core as mx

    x = mx.random.normal((1 << 20,))
    mx.eval(x + 1, x.sum())
    steps = {"started": status()["VmRSS"]}
    for k in range(1, count + 1):
        function = mx.compile(lambda a, k=k: mx.sin(a * k + 0.5) * mx.exp(a - k))
        mx.eval(function(x))
        if k in (1, 2, 5, 10, 20, 40, 80) or k == count:
            steps[str(k)] = status()["VmRSS"]
    print(json.dumps({"resident MiB after this many compiled kernels": steps, **heap()}), flush=True)


def fresh_processes(flag: str, names: list[str]) -> None:
    """Each of ``names`` by ``flag`` in a fresh process of this module."""
    import subprocess
    import sys

    for name in names:
        subprocess.run([sys.executable, "-m", "benchmarks.mlx_memory_bench", flag, name], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pass", dest="path", help="a .kv file: measure a full mlx pass over it")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--operations", action="store_true", help="each operation's first-use cost")
    parser.add_argument("--operation", choices=sorted(OPERATIONS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--selections", action="store_true", help="each group selection's per-piece function, fresh"
    )
    parser.add_argument("--selection", choices=sorted(SELECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--modules", type=int, help="resident set as N compiled kernels load")
    args = parser.parse_args()
    if args.operation:
        operation(args.operation)
    elif args.selection:
        selection(args.selection)
    elif args.selections:
        fresh_processes("--selection", list(SELECTIONS))
    elif args.modules:
        modules(args.modules)
    elif args.operations:
        fresh_processes("--operation", list(OPERATIONS))
    elif args.path:
        one_pass(args.path, args.jobs, args.passes)
    else:
        steps()


if __name__ == "__main__":
    main()
