"""The ``kvsnap`` command line: `main` and `build_parser` (in `shell`, loaded on first use), the
console script's early start (`launch`), the conformance runner and the generated reference page.
The option types and errors every stage's commands share are below the stages
(`kvsnap.arguments`, `kvsnap.errors`); importing this package, or those, loads the standard
library only: the console script reads the commands' options before numpy is imported
(`kvsnap.analysis.commands.early_start`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsnap.exports import exports

if TYPE_CHECKING:
    from .shell import build_parser, main

__all__ = ["build_parser", "main"]

__getattr__, __dir__ = exports(__name__, __file__, __all__)
