"""capture: mlx-lm KV caches into `.kv` snapshots, during or after generation, and back.

Installed as `kvsnap.capture` (``import kvsnap.capture`` or ``kvsnap.generate``).

`generate` streams like `mlx_lm.stream_generate` while taking snapshots; `snapshot_kv` takes one
of any prompt cache; `restore` builds a live prompt cache from a snapshot.
"""

from kvsnap.capture.errors import CaptureError, UnsupportedModelError
from kvsnap.capture.generate import SnapshotEvent, generate
from kvsnap.capture.restore import restore, text_of, tokens_of
from kvsnap.capture.snapshot import KVSnapshot, snapshot_kv

__all__ = [
    "CaptureError",
    "KVSnapshot",
    "SnapshotEvent",
    "UnsupportedModelError",
    "generate",
    "restore",
    "snapshot_kv",
    "text_of",
    "tokens_of",
]
