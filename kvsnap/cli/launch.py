"""The ``kvsnap`` command's entry point: it starts what the command will wait for (the CPU
workers' fork server: `kvsnap.analysis.commands.early_start`) before importing anything heavy, then runs
`kvsnap.cli.main`. Importing this module loads the standard library only."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``kvsnap`` with ``argv`` (default: the process's arguments); the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:  # by name: kvsnap.analysis is the repository's analysis/ folder, mapped at install
        early_start = importlib.import_module("kvsnap.analysis.commands.early_start")
    except ImportError:  # the analysis stage's files missing: the command says what is wrong
        pass
    else:
        early_start.start_early(args)
    from kvsnap.cli import main as run

    return run(args)


def console() -> None:
    """The console script (and ``python -m kvsnap``): `main`, then the process's end.

    A command that drove mlx's device ends the process at once (`os._exit`) once its output is
    written and flushed: at interpreter exit mlx frees its cached device buffers and its CUDA
    context one by one (`python -m benchmarks.exit_bench` times it), all of which the
    operating system frees anyway. Not where a child process or a thread the interpreter would wait
    for is still alive, and never for `main` called in a process that goes on."""
    code = main()
    if "mlx.core" in sys.modules:
        _end_now(code)
    raise SystemExit(code)


def _end_now(code: int) -> None:
    """`os._exit` with ``code`` after flushing the standard streams and logging, unless a child
    process or a thread the interpreter would wait for (not a daemon) is alive: their work
    stays the interpreter's to finish."""
    import multiprocessing
    import threading

    if multiprocessing.active_children():
        return
    first = threading.main_thread()
    if any(t is not first and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    if "logging" in sys.modules:
        import logging

        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to write there
            stream.flush()
    os._exit(code)
