"""The ``kvsnap`` command line: `main` and `build_parser` (in `shell`, loaded on first use), the
option types every stage's commands share (`options`), the one-line errors (`errors`), the
console script's early start (`launch`), the conformance runner and the generated reference page.
Importing this package, or `options`, loads the standard library only: the console script reads
the commands' options before numpy is imported (`kvsnap.analysis.engine.fork_server`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsnap.exports import exports

if TYPE_CHECKING:
    from .shell import build_parser, main

__all__ = ["build_parser", "main"]

__getattr__, __dir__ = exports(__name__, __file__, __all__)
