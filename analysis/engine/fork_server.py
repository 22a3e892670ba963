"""The CPU backend's fork server (`analysis.engine.processes`), startable before anything heavy is
imported: this module needs the standard library, `analysis.engine.parallel`,
`analysis.engine.executors`, the kernels' names and profiles (`analysis.kernels`) and the
``stats`` command's argument definitions (`analysis.commands.options`), none of which imports
numpy.

A fresh ``kvsnap stats FILE`` of a big file waits for its workers: the fork server imports numpy
and the kernels (`warm_kernels`: the C library of `native`) before it forks the first worker, and
started only once the command had imported numpy, built its parser and read its arguments, it
would start late (`python -m benchmarks.cli_bench` measures a
fresh command). `start_early` starts it as the ``kvsnap`` process begins, for the command that will
want it (the default ``kvsnap stats`` of one big local file); `processes` then finds it running."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import NoReturn

from ..commands.options import stats_arguments
from ..dependencies import multiprocessing
from ..kernels import NAMES, profile
from .executors import main_hidden, one_thread_environment
from .parallel import cores

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


_DEFAULTS_CHANGED = ("engine", "jobs", "merge", "address", "stats")
"""Options that, set to anything but their default, leave the decision to the command (which may
not start CPU workers at all)."""


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
    starts CPU workers. Read with the command's own argument definitions, before the command
    parses them (a misread costs an idle server, not a wrong result: the command decides for
    itself)."""
    if len(argv) < 2 or argv[0] != "stats" or cores() < 2:
        return False
    if _local_size(_only_file(argv[1:])) < process_min_bytes(cores()):
        return False

    return START_METHOD in multiprocessing.get_all_start_methods()


def _only_file(tokens: Sequence[str]) -> str | None:
    """The one file ``kvsnap stats`` with arguments ``tokens`` reads when they leave the backend
    one whose workers this server forks (the default, or ``--backend cpu`` spelled out) and the
    options of `_DEFAULTS_CHANGED` at their defaults; None for no file, several, another backend,
    a changed default or arguments the command would refuse. Read with the command's own
    argument definitions (`analysis.commands.options.stats_arguments`)."""
    parser = _Parser(add_help=False)
    stats_arguments(parser)
    try:
        args, _ = parser.parse_known_args(tokens)
    except argparse.ArgumentError:  # the command refuses them, and says so itself
        return None
    if len(args.files) != 1 or args.backend not in NAMES:
        return None
    given = vars(args)
    if any(given[name] != parser.get_default(name) for name in _DEFAULTS_CHANGED):
        return None
    kernel = profile(args.backend)
    return args.files[0] if kernel.worker_processes and kernel.start_method == START_METHOD else None


class _Parser(argparse.ArgumentParser):
    """The command's parser, raising `argparse.ArgumentError` where argparse would print the
    usage and exit."""

    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)


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
