"""The command line's own error: a command that ran and has nothing to give (every file failed, a
statistic the table does not hold). `main` prints it as one line and exits with its `status`."""

from __future__ import annotations

from kvformat import KVSnapError


class CommandError(KVSnapError, RuntimeError):
    """A command cannot give what was asked; exit status `status` (1: the command ran)."""

    status = 1


class OptionsConflictError(CommandError):
    """Options that do nothing together (one would be ignored): exit status 2, before any work."""

    status = 2
