"""Token ids and token pieces a snapshot records (SPEC 15.3), resolved through a series' parents.

A series stores the full lists (``tokens``, ``token_pieces``) in its first snapshot and only
what each later snapshot added (``tokens_appended``, ``token_pieces_appended``); a one-shot file
stores the full lists.
"""

from __future__ import annotations

from typing import Any

import kvformat


def _per_sequence(value: Any) -> list[list[Any]] | None:
    if isinstance(value, list) and value and all(isinstance(seq, list) for seq in value):
        return [list(seq) for seq in value]
    return None


def recorded(snap: kvformat.Snapshot, key: str) -> list[list[Any]] | None:
    """Per sequence, the full list the snapshot records under ``key`` (``"tokens"`` or
    ``"token_pieces"``): its own, or its nearest ancestor's followed by every ``key + "_appended"``
    on the way back to it. None where the file does not record it."""
    parts: list[list[list[Any]]] = []
    index: int | None = snap.index
    while index is not None:
        view = snap if index == snap.index else snap.select(index)
        full = _per_sequence(view.snapshot_metadata.get(key))
        if full is not None:
            for part in reversed(parts):
                for seq, items in zip(full, part, strict=False):
                    seq.extend(items)
            return full
        part = _per_sequence(view.snapshot_metadata.get(f"{key}_appended"))
        if part is None:
            return None
        parts.append(part)
        index = view.parent
    return None


def token_ids(snap: kvformat.Snapshot) -> list[list[int]] | None:
    """Every token id the snapshot holds, per sequence (position ``p`` holds ``ids[seq][p]``)."""
    ids = recorded(snap, "tokens")
    return None if ids is None else [[int(t) for t in seq] for seq in ids]


def token_pieces(snap: kvformat.Snapshot) -> list[list[str]] | None:
    """Each token's text decoded alone, per sequence, aligned with `token_ids`."""
    pieces = recorded(snap, "token_pieces")
    return None if pieces is None else [[str(p) for p in seq] for seq in pieces]
