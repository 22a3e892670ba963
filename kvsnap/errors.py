"""The commands' own errors: a command that ran and has nothing to give (every file failed, a
statistic the table does not hold), and options that conflict. The shell (`kvsnap.cli.main`)
prints one as one line and exits with its `status`. Below the stages, as `kvsnap.arguments`."""

from __future__ import annotations

from kvformat import KVSnapError

BUG_REPORT = (
    "kvsnap: this is a bug in kvsnap, not a problem with your input or files: please report it "
    "to the kvsnap maintainers with the traceback above and the command line ({command} ...)"
)
"""The line the shell prints under the traceback of an exception kvsnap did not raise on purpose."""


class CommandError(KVSnapError, RuntimeError):
    """A command cannot give what was asked; exit status `status` (1: the command ran)."""

    status = 1


class OptionsConflictError(CommandError):
    """Options that do nothing together (one would be ignored): exit status 2, before any work."""

    status = 2
