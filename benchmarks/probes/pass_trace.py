"""Where the time of a pass on worker processes goes: every worker's tasks and the stages inside
them (copies into staging buffers, device launches, waits for the device, folds, sealing rows),
timed in every process, then summed per pass.

    python -m benchmarks.probes.pass_trace FILE [--backend mlx] [--jobs 16] [--passes 3] [--stats all]

The pass runs in a child process whose ``PYTHONPATH`` starts with a generated
``sitecustomize.py``: every interpreter of the pass imports it, the fork server too (a fresh
interpreter), so the workers forked from it run wrapped functions (kvsnap itself is unchanged;
mlx is not imported there, as a CUDA context must not cross a fork). Each process appends
``(stage, pid, thread, start, end)`` to its own file; the summary is per pass: per stage its
total over all processes and mean per call; per worker its tasks and busy time; for the first
pass (which starts the workers and loads or compiles what later passes reuse) also when the
workers' first tasks began. The tracer imports kvsnap's kernels (C) into every
interpreter, the parent's too: a fresh process's start is not what it measures.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SITE = r"""
import os
if os.environ.get("KVSNAP_TRACE_DIR"):
    import functools, json, threading, time
    _events, _lock, _dir = [], threading.Lock(), os.environ["KVSNAP_TRACE_DIR"]

    def _flush():
        with _lock:
            events = list(_events)
            _events.clear()
        with open(os.path.join(_dir, f"{os.getpid()}.jsonl"), "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)

    def _wrap(owner, name, stage, flush=False):
        function = getattr(owner, name)

        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.time()
            try:
                return function(*args, **kwargs)
            finally:
                with _lock:
                    _events.append((stage, os.getpid(), threading.get_ident(), start, time.time()))
                if flush:
                    _flush()

        setattr(owner, name, timed)

    import atexit
    atexit.register(_flush)  # a pass in this process (one process on mlx) flushes at its end

    from kvsnap.analysis.kernels import mlx as mlx_backend

    from kvsnap.analysis.kernels import mlx_fold, mlx_pipeline, mlx_staging
    from kvsnap.analysis.engine import accumulator, plan, processes, rows

    _wrap(mlx_staging.Staging, "start_fill", "copy started")
    _wrap(mlx_staging._Fill, "result", "copy wait")
    _wrap(mlx_pipeline._Batch, "launch", "launch (copy wait included)")
    _wrap(mlx_pipeline._Batch, "fetch", "device wait and fetch")
    _wrap(mlx_pipeline._Batch, "_fold_all", "fold")
    _wrap(mlx_pipeline.Pipeline, "finish", "pipeline drain")
    _wrap(accumulator.HeadAccumulator, "seal", "seal (row)")
    _wrap(rows, "compute", "rows (a layer's, stacked)")
    _wrap(mlx_pipeline, "to_host", "results to host")
    _wrap(plan, "add_segments", "read and add")
    _wrap(processes, "_device", "device start (every task)")
    _wrap(processes, "_run_task", "task", flush=True)
"""

CHILD = r"""
import json, sys, time
from kvsnap.analysis.engine.tables import stats_for_file
path, stats, jobs, backend, passes, marks = sys.argv[1:7]
spans = []
for i in range(int(passes)):
    start = time.time()
    rows = sum(t.num_rows for t in stats_for_file(path, stats=stats, jobs=int(jobs), backend=backend))
    spans.append((start, time.time()))
    print(f"pass {i}: {spans[-1][1] - start:.3f} s, {rows} rows", file=sys.stderr, flush=True)
json.dump(spans, open(marks, "w"))
"""


def summarize(directory: Path, spans: list[tuple[float, float]]) -> str:
    """A markdown summary per pass (the first one loads or compiles what the later ones reuse;
    its table also gives when each worker's first task began, after the pass's start)."""
    events = [
        json.loads(line)
        for file in sorted(directory.glob("*.jsonl"))
        for line in file.read_text().splitlines()
    ]
    lines = []
    for number, (start, end) in enumerate(spans):
        inside = [e for e in events if e[3] >= start and e[4] <= end + 0.01]
        if number == 0:
            begun: dict[int, float] = {}
            for e in inside:
                if e[0] == "task":
                    begun[e[1]] = min(begun.get(e[1], e[3]), e[3])
            offsets = sorted(t - start for t in begun.values())
            if offsets:
                lines.append(
                    f"pass 0: first tasks began {offsets[0] * 1e3:.0f}-{offsets[-1] * 1e3:.0f} ms "
                    "after its start"
                )
        lines.append(
            f"\npass {number}: {end - start:.3f} s\n\n"
            "| stage | total, all processes | calls | mean | first start, last end (ms into the pass) |"
        )
        lines.append("|---|---:|---:|---:|---:|")
        totals: dict[str, float] = collections.defaultdict(float)
        calls: collections.Counter[str] = collections.Counter()
        spans: dict[str, tuple[float, float]] = {}
        for stage, _, _, t0, t1 in inside:
            totals[stage] += t1 - t0
            calls[stage] += 1
            first, last = spans.get(stage, (t0, t1))
            spans[stage] = (min(first, t0), max(last, t1))
        for stage, total in sorted(totals.items(), key=lambda item: -item[1]):
            first, last = spans[stage]
            lines.append(
                f"| {stage} | {total:.3f} s | {calls[stage]} | {total / calls[stage] * 1e3:.2f} ms "
                f"| {(first - start) * 1e3:.0f}, {(last - start) * 1e3:.0f} |"
            )
        tasks = [e for e in inside if e[0] == "task"]
        workers = sorted({e[1] for e in tasks})
        busy = [sum(e[4] - e[3] for e in tasks if e[1] == pid) for pid in workers]
        if busy:
            per_worker = sorted(collections.Counter(e[1] for e in tasks).values())
            lines.append(
                f"\n{len(workers)} workers, {len(tasks)} tasks ({per_worker} per worker); busy per worker "
                f"{min(busy) * 1e3:.0f}-{max(busy) * 1e3:.0f} ms of {(end - start) * 1e3:.0f} ms"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("file")
    parser.add_argument("--backend", default="mlx", choices=["cpu", "mlx"])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--stats", default="all")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as site, tempfile.TemporaryDirectory() as trace:
        Path(site, "sitecustomize.py").write_text(SITE)
        marks = Path(trace, "marks.json")
        path = os.pathsep.join([site, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)])
        env = {**os.environ, "PYTHONPATH": path, "KVSNAP_TRACE_DIR": trace}
        command = [args.file, args.stats, str(args.jobs), args.backend, str(args.passes), str(marks)]
        subprocess.run([sys.executable, "-c", CHILD, *command], env=env, check=True)
        print(summarize(Path(trace), json.loads(marks.read_text())))


if __name__ == "__main__":
    main()
