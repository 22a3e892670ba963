"""`kvsnap.view(path)`: the viewer inline in Jupyter, served by a `ViewerServer` on a thread of the
kernel's process (loopback, behind its token) and shown in an ``IFrame``."""

from __future__ import annotations

import os
from typing import Any

from kvformat.errors import InvalidArgumentError

from .data import Source, ViewerError
from .server import ViewerServer


class NotInNotebookError(ViewerError):
    """`view` was called outside a Jupyter kernel (a script, a plain Python prompt)."""


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel that can show an ``IFrame`` (IPython installed and
    its running shell a kernel's, not a terminal's)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def view(
    *paths: str | os.PathLike[str], height: int = 900, storage_options: dict[str, Any] | None = None
) -> Any:
    """Show the viewer of one file (or two, compared) in a notebook cell; the server stops with the
    kernel. Returns the ``IPython.display.IFrame`` (its ``src`` is the URL, token included)."""
    if not 1 <= len(paths) <= 2:
        raise InvalidArgumentError("view takes one file, or two to compare")
    if not in_notebook():
        names = " ".join(os.fspath(path) for path in paths)
        raise NotInNotebookError(
            f"kvsnap.view shows the viewer in a Jupyter notebook cell, and this is not one: from a "
            f"shell, 'kvsnap view {names}' serves it to the browser ('--html view.html' writes one page)"
        )
    from IPython.display import IFrame

    server = ViewerServer([Source(os.fspath(path), storage_options) for path in paths])
    server.start()
    return IFrame(server.url, width="100%", height=height)
