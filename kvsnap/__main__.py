"""``python -m kvsnap ...``: the ``kvsnap`` command (`kvsnap.cli.launch`)."""

from kvsnap.cli.launch import console

console()
