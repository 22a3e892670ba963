"""capture: mlx-lm KV caches into `.kv` snapshots, during or after generation, and back.

Installed as `kvsnap.capture` (``import kvsnap.capture`` or ``kvsnap.generate``).

`generate` streams like `mlx_lm.stream_generate` while taking snapshots; `snapshot_kv` takes one
of any prompt cache; `restore` builds a live prompt cache from a snapshot.

Names load on first use (PEP 562): importing a submodule, such as the CLI's, does not load mlx.
"""

from __future__ import annotations

if __name__ != "kvsnap.capture":  # the folder capture/ installs as kvsnap.capture, under that name alone
    raise ImportError(
        f"capture/ is the package kvsnap.capture: import it as kvsnap.capture, not as {__name__!r} "
        "(install the repository: pip install -e .)"
    )

from typing import TYPE_CHECKING

from kvsnap.exports import exports

if TYPE_CHECKING:
    from .errors import CaptureError, UnsupportedModelError
    from .fixtures import fetch_model
    from .generation import Capture, SnapshotEvent, generate
    from .resume import restore, text_of, tokens_of
    from .snapshot import KVSnapshot, snapshot_kv

__all__ = [
    "Capture",
    "CaptureError",
    "KVSnapshot",
    "SnapshotEvent",
    "UnsupportedModelError",
    "fetch_model",
    "generate",
    "restore",
    "snapshot_kv",
    "text_of",
    "tokens_of",
]


__getattr__, __dir__ = exports(__name__, __file__, __all__)
