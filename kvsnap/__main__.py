"""``python -m kvsnap ...``: the ``kvsnap`` command (`kvsnap.launch`)."""

from kvsnap.launch import console

console()
