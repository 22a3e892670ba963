"""The CPU backend's fork server (`analysis.engine.processes`), startable before anything heavy is
imported: this module needs the standard library, `analysis.engine.parallel` and the kernels'
names and profiles (`analysis.kernels`, which imports nothing heavy) only.

A fresh ``kvsnap stats FILE`` of a big file waits for its workers: the fork server imports numpy and
the kernels (`warm_kernels`: the C library of `native`) before it forks the first worker, and started
only once the command had imported numpy, built
its parser and read its arguments, it would start late (`python -m benchmarks.cli_bench` measures a
fresh command). `start_early` starts it as the ``kvsnap`` process begins, for the command that will
want it (the default ``kvsnap stats`` of one big local file); `processes` then finds it running."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..dependencies import multiprocessing
from ..kernels import DEFAULT as DEFAULT_KERNEL
from ..kernels import NAMES, profile
from .parallel import cores, main_hidden, one_thread_environment

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


_DEFAULTS_CHANGED = ("--engine", "--jobs", "--merge", "--address", "--stats")
"""Options after which `start_early` leaves the decision to the command (which may not start
CPU workers at all)."""

_WITH_VALUE = (
    "-o",
    "--output",
    "--factor",
    "--snapshot",
    "--keys",
    "--window",
    "--needle",
    "--retrieval",
    "--storage-option",
)


def ensure_running() -> None:
    """Start the fork server now unless it runs: BLAS and OpenMP limited to one thread in its
    environment (its workers inherit it), ``__main__`` hidden from it."""

    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload(PRELOAD)
    with one_thread_environment(), main_hidden():
        from multiprocessing import forkserver

        forkserver.ensure_running()


def wanted(argv: Sequence[str]) -> bool:
    """Whether ``kvsnap`` run with ``argv`` is the default ``kvsnap stats FILE`` of one local
    file of at least `PROCESS_MIN_BYTES`, on a machine with more than one core: the command that
    starts CPU workers. Read from the tokens alone (a misread costs an idle server, not a wrong
    result: the command decides for itself)."""
    if len(argv) < 2 or argv[0] != "stats" or cores() < 2:
        return False
    if _local_size(_only_file(argv[1:])) < process_min_bytes(cores()):
        return False

    return START_METHOD in multiprocessing.get_all_start_methods()


def _only_file(tokens: Sequence[str]) -> str | None:
    """The one positional argument of ``tokens`` when they leave the backend one whose workers
    this server forks (the default, or ``--backend cpu`` spelled out) and every other default as
    it is; None for no file, several, another backend or an option that changes the defaults
    (`_DEFAULTS_CHANGED`)."""
    scanned = _scan(tokens)
    if scanned is None or len(scanned[0]) != 1 or scanned[1] not in NAMES:
        return None
    kernel = profile(scanned[1])
    return scanned[0][0] if kernel.worker_processes and kernel.start_method == START_METHOD else None


def _scan(tokens: Sequence[str]) -> tuple[list[str], str] | None:
    """The positional arguments of ``tokens`` and the backend they choose; None where an option
    changes the defaults (`_DEFAULTS_CHANGED`)."""
    files = []
    chosen = DEFAULT_KERNEL
    rest = iter(tokens)
    for token in rest:
        name, equals, value = token.partition("=")
        if name == "--backend":
            chosen = value if equals else next(rest, "")
        elif name in _DEFAULTS_CHANGED:
            return None
        elif token in _WITH_VALUE:
            next(rest, None)
        elif not token.startswith("-"):
            files.append(token)
    return files, chosen


def _local_size(file: str | None) -> int:
    """The size of local ``file`` in bytes; 0 for None, a URL or a file that cannot be read."""
    if file is None or "://" in file:
        return 0
    try:
        return os.stat(file).st_size
    except OSError:
        return 0


def start_early(argv: Sequence[str]) -> None:
    """`ensure_running` when `wanted` says the command will use the fork server; never raises
    (the command then starts it itself, or reports what is wrong)."""
    try:
        if wanted(argv):
            ensure_running()
    except Exception:
        pass
