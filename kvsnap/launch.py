"""The ``kvsnap`` command's entry point: it starts what the command will wait for (the CPU
workers' fork server, `kvsnap.analysis.fork_server`) before importing anything heavy, then runs
`kvformat.cli.main`. Importing this module loads the standard library only."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """``kvsnap`` with ``argv`` (default: the process's arguments); the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:  # by name: kvsnap.analysis is the repository's analysis/ folder, mapped at install
        fork_server = importlib.import_module("kvsnap.analysis.fork_server")
    except ImportError:  # the analysis stage's files missing: the command says what is wrong
        pass
    else:
        fork_server.start_early(args)
    from kvformat.cli import main as run

    return run(args)
