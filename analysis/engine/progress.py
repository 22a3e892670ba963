"""Progress bars on stderr (tqdm), made only where they show: a bar that stays hidden (stderr
not a terminal, or not asked for) is a stand-in with the same few methods, and tqdm is not
imported for it (its import reads the installed packages' metadata, which a ``kvsnap stats``
piped to a file would pay for and never show)."""

from __future__ import annotations

import sys
from typing import Any

from ..dependencies import tqdm


class Hidden:
    """A bar nobody sees: counts, draws nothing (what tqdm's own disabled bar does)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.n = 0

    def update(self, count: int = 1) -> None:
        self.n += count

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Hidden:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(total: int, show: bool = True, **options: Any) -> Any:
    """A tqdm bar of ``total`` steps on stderr (``options``: tqdm's, e.g. ``unit``, ``desc``),
    left when done; `Hidden` when ``show`` is false or stderr is not a terminal."""
    if not (show and _terminal()):
        return Hidden(total)
    return tqdm.tqdm(total=total, file=sys.stderr, leave=False, **options)


def _terminal() -> bool:
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced or closed
        return False
