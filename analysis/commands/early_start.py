"""Whether the command ``kvsnap`` was started with will fork CPU workers, decided before anything
heavy is imported, and the fork server started early for it (`engine.fork_server`). This module
needs the standard library, the ``stats`` command's argument definitions (`commands.options`),
the kernels' names and profiles and the engine's fork server, none of which imports numpy; the
console script (`kvsnap.cli.launch`) calls `start_early` first."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import NoReturn

from ..dependencies import multiprocessing
from ..engine.fork_server import START_METHOD, ensure_running, process_min_bytes
from ..kernels import NAMES, profile
from ..machine import cores
from .options import stats_arguments

_DEFAULTS_CHANGED = ("engine", "jobs", "merge", "address", "stats")
"""Options that, set to anything but their default, leave the decision to the command (which may
not start CPU workers at all)."""


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
