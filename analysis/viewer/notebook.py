"""`kvsnap.view(path)`: the viewer inline in Jupyter, served by a `ViewerServer` on a thread of the
kernel's process (loopback, behind its token) and shown in an ``IFrame``."""

from __future__ import annotations

import os
from typing import Any

from .data import Source
from .server import ViewerServer


def view(
    *paths: str | os.PathLike[str], height: int = 900, storage_options: dict[str, Any] | None = None
) -> Any:
    """Show the viewer of one file (or two, compared) in a notebook cell; the server stops with the
    kernel. Returns the ``IPython.display.IFrame`` (its ``src`` is the URL, token included)."""
    if not 1 <= len(paths) <= 2:
        raise ValueError("view takes one file, or two to compare")
    from IPython.display import IFrame

    server = ViewerServer([Source(os.fspath(path), storage_options) for path in paths])
    server.start()
    return IFrame(server.url, width="100%", height=height)
