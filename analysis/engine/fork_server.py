"""The CPU backend's fork server (`analysis.engine.processes`), startable before anything heavy is
imported: this module needs the standard library, `analysis.engine.parallel` and
`analysis.engine.executors`, none of which imports numpy.

A fresh ``kvsnap stats FILE`` of a big file waits for its workers: the fork server imports numpy
and the kernels (`warm_kernels`: the C library of `native`) before it forks the first worker, and
started only once the command had imported numpy, built its parser and read its arguments, it
would start late (`python -m benchmarks.cli_bench` measures a fresh command).
`analysis.commands.early_start` starts it (`ensure_running`) as the ``kvsnap`` process begins, for
the command that will want it; `processes` then finds it running."""

from __future__ import annotations

from ..dependencies import multiprocessing
from .executors import main_hidden, one_thread_environment

START_METHOD = "forkserver"
PRELOAD = ["kvsnap.analysis.engine.warm_kernels"]
"""What the fork server imports before it forks a worker: the kernels, their code loaded."""

PROCESS_MIN_BYTES = 16 << 20
"""On 16 cores or more: smaller files with fewer than `PROCESS_MIN_HEADS` heads stay in one
process (on threads) unless the workers are already running, since starting them would cost more
than they save (`python -m benchmarks.cli_bench` measures both)."""

PROCESS_MIN_HEADS = 48
"""On 16 cores or more: (layer, KV head) pairs from which a file goes to worker processes whatever
its size: on many threads of one process each head costs time under the interpreter's lock (its
row, its accumulators), however few its tokens."""

FULL_CORES = 16
"""The core count the two thresholds above hold for. On fewer cores workers save less (a pass
on ``c`` cores saves at most ``1 - 1/c`` of its time) and threads contend less for the lock, so
both thresholds grow as ``FULL_CORES / c``: on 2 cores a file goes to workers from 128 MiB or 384
heads (the break-even measured there: `benchmarks/RESULTS.md`'s table)."""


def process_min_bytes(count: int) -> int:
    """`PROCESS_MIN_BYTES` scaled to ``count`` cores (see `FULL_CORES`)."""
    return PROCESS_MIN_BYTES * max(1, FULL_CORES // max(count, 1))


def process_min_heads(count: int) -> int:
    """`PROCESS_MIN_HEADS` scaled to ``count`` cores (see `FULL_CORES`)."""
    return PROCESS_MIN_HEADS * max(1, FULL_CORES // max(count, 1))


def ensure_running() -> None:
    """Start the fork server now unless it runs: BLAS and OpenMP limited to one thread in its
    environment (its workers inherit it), ``__main__`` hidden from it."""

    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload(PRELOAD)
    with one_thread_environment(), main_hidden():
        from multiprocessing import forkserver

        forkserver.ensure_running()
