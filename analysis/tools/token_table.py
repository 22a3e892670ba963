"""Per-token scalars of a snapshot as a Polars LazyFrame (`token_table`): norms, non-finite
counts, the token each position holds and, for a file with queries, SnapKV's score of each prompt
key."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import kvformat

from ..attention.compression import snapkv_scores
from ..attention.tokens import token_ids, token_pieces
from ..dependencies import pl


def token_table(
    path: str | os.PathLike[str], snapshot: int = -1, storage_options: dict[str, Any] | None = None
) -> pl.LazyFrame:
    """Per-token scalars as a LazyFrame, built chunk by chunk: seq, layer, head, position,
    k_norm, v_norm, k_absmax, k_nonfinite and v_nonfinite (how many of the row's values are inf
    or NaN; the row's norms are then null), and where the file records them (SPEC 15.3)
    ``token_id`` and ``token_text`` (the token decoded alone), null where it does not; and for a
    file with queries ``snapkv_score``: SnapKV's score of each prompt key (the attention of the last
    32 prompt queries, summed over them and the query heads of the KV head, max-pooled over 5 keys;
    `analysis.attention.compression.snapkv_scores`), null elsewhere."""

    frames = []
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        ids, pieces = token_ids(snap), token_pieces(snap)
        snapkv = snapkv_scores(snap)

        def label(values: list[list[Any]] | None, seq: int, positions: np.ndarray) -> list[Any]:
            known = values[seq] if values is not None and seq < len(values) else []
            return [known[p] if p < len(known) else None for p in positions.tolist()]

        def scalar(values: np.ndarray, bad: np.ndarray) -> pl.Series:
            return pl.Series(np.where(bad > 0, np.nan, values)).fill_nan(None)

        for block in snap.blocks():
            where = (block.seq, block.layer, block.head)
            k = np.asarray(block.k, dtype=np.float32)
            v = np.asarray(block.v, dtype=np.float32)
            k_bad = (~np.isfinite(k)).sum(axis=1)
            v_bad = (~np.isfinite(v)).sum(axis=1)
            with np.errstate(all="ignore"):
                k_norm, v_norm = np.linalg.norm(k, axis=1), np.linalg.norm(v, axis=1)
                k_absmax = np.abs(k).max(axis=1) if k.size else np.empty(0, np.float32)
            frames.append(
                pl.DataFrame(
                    {
                        "seq": np.full(block.positions.size, block.seq, np.int32),
                        "layer": np.full(block.positions.size, block.layer, np.int32),
                        "head": np.full(block.positions.size, block.head, np.int32),
                        "position": block.positions,
                        "k_norm": scalar(k_norm, k_bad),
                        "v_norm": scalar(v_norm, v_bad),
                        "k_absmax": scalar(k_absmax, k_bad),
                        "k_nonfinite": k_bad.astype(np.int32),
                        "v_nonfinite": v_bad.astype(np.int32),
                        "token_id": pl.Series(label(ids, block.seq, block.positions), dtype=pl.Int64),
                        "token_text": pl.Series(label(pieces, block.seq, block.positions), dtype=pl.Utf8),
                        "snapkv_score": _scores_at(snapkv.get(where), block.positions),
                    }
                )
            )
    if not frames:
        return pl.LazyFrame()
    return pl.concat(frames).lazy()


def _scores_at(scores: tuple[np.ndarray, np.ndarray] | None, positions: np.ndarray) -> pl.Series:
    """Per-key scores ``(key positions, values)`` at ``positions`` (a Float64 column; null where
    there is none or it is NaN)."""

    if scores is None:
        return pl.Series([None] * positions.size, dtype=pl.Float64)
    keys, values = scores
    at = np.searchsorted(keys, positions)
    inside = (at < keys.size) & (keys[np.minimum(at, keys.size - 1)] == positions)
    found = np.where(inside, values[np.minimum(at, keys.size - 1)], np.nan)
    return pl.Series(found, dtype=pl.Float64).fill_nan(None)
