"""Making a rename durable: what `Writer.close` and `recover` do after moving a file into place."""

from __future__ import annotations

import os


def fsync_directory(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
