"""Head importance from saved attention (format 1.3 files with queries): per (layer, query head),
the quantities the KV-compression literature reports, recomputed offline from the file.

Every score is a function of the attention weights `kvformat.attention` recomputes (float32, the
layer's recorded mask, scale, softcap and sinks), taken a block of queries at a time, so memory
is one block's ``(BLOCK, n_keys)`` map plus the head's K and V:

- ``sink_mass``: mean over queries of the weight on key positions ``< SINKS`` (StreamingLLM's
  attention sinks); ``local_mass``: on the visible keys less than ``LOCAL`` positions back.
- ``entropy`` (nats) of each query's weights, and ``entropy_normalized``: divided by the log of
  the number of keys the query sees (1 = uniform; queries that see one key count as 0).
- ``mean_distance``: query position minus key position, attention-weighted, averaged.
- ``top1_position_histogram``: the position of each query's most-attended key in the
  norm-by-position bins (`catalogue.position_bins`: 0, [1,2), [2,4), ...).
- ``retrieval_score`` (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
  Factuality"): over the queries whose next token (the token at position + 1) copies a token
  present earlier in the context (or in ``needle``, a ``[start, stop)`` span of positions), the
  fraction whose top-1 key holds that token; ``retrieval_events`` is how many such queries.
- ``streaming_error`` (DuoAttention's question, without training): the relative error
  ``||o' - o|| / ||o||`` over all queries of the head's attention output when it may only see
  the first ``SINKS`` keys plus the last ``window`` positions (``o' `` renormalized over those).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvformat
from kvformat import attention as attention_math

from .catalogue import POSITION_BINS, position_bins
from .tokens import token_ids

SINKS = 4  # key positions counted as sinks
LOCAL = 64  # positions back that count as local
WINDOW = 256  # default recent window of `streaming_error`

COLUMNS = (
    "n_queries",
    "sink_mass",
    "local_mass",
    "entropy",
    "entropy_normalized",
    "mean_distance",
    "top1_position_histogram",
    "retrieval_score",
    "retrieval_events",
    "streaming_error",
)


SCALARS = (
    "sink_mass",
    "local_mass",
    "entropy",
    "entropy_normalized",
    "mean_distance",
    "retrieval_score",
    "streaming_error",
)
"""The one-number columns, for ``kvsnap plot --stat`` (a layers x query heads heatmap)."""


class NoQueriesError(ValueError):
    """The file holds no queries: the attention statistics need a capture with ``--queries``."""


def query_layers(snap: kvformat.Snapshot) -> list[int]:
    """The layers of ``snap`` that hold queries (maybe none)."""
    return [i for i, spec in enumerate(snap.layers) if spec.present and spec.queries is not None]


def layers_with_queries(snap: kvformat.Snapshot) -> list[int]:
    """The layers of ``snap`` that hold queries; raises `NoQueriesError` when none does."""
    found = query_layers(snap)
    if not found:
        raise NoQueriesError(
            f"{snap.name} holds no queries: capture with --queries decode|window:W|all "
            "(kvsnap capture ... --queries window:64) for attention statistics"
        )
    return found


@dataclass
class _Sums:
    """Running sums of one head's scores over query blocks."""

    queries: int = 0
    sink: float = 0.0
    local: float = 0.0
    entropy: float = 0.0
    entropy_normalized: float = 0.0
    distance: float = 0.0
    error_sq: float = 0.0
    output_sq: float = 0.0
    events: int = 0
    hits: int = 0

    def __post_init__(self) -> None:
        self.histogram = np.zeros(POSITION_BINS, np.int64)


def _entropy(weights: np.ndarray) -> np.ndarray:
    """``-sum w log w`` per row (nats), 0 log 0 = 0."""
    positive = weights > 0
    logs = np.log(np.where(positive, weights, 1.0))
    return -(weights * logs).sum(axis=1)


def head_scores(
    snap: kvformat.Snapshot,
    layer: int,
    head: int,
    *,
    seq: int = 0,
    window: int = WINDOW,
    needle: tuple[int, int] | None = None,
    tokens: list[int] | Copies | None = None,
) -> dict[str, Any]:
    """The scores of query head ``head`` of ``layer`` (see the module's docstring), over every query
    the snapshot holds for it. ``tokens``: the sequence's token ids (position ``p`` holds
    ``tokens[p]``; or their `copy_events`), needed for ``retrieval_score`` (NaN without them)."""
    spec = snap.layers[layer].queries
    if spec is None:
        raise NoQueriesError(f"layer {layer} holds no queries")
    kv = snap.head(layer, spec.kv_heads[head], seq)
    assert kv is not None
    values = np.asarray(kv.v, np.float32)
    copies = tokens if isinstance(tokens, Copies) or tokens is None else copy_events(tokens, needle)
    sums = _Sums()
    for block in attention_math.blocks(snap, layer, head, seq=seq):
        _add_block(sums, spec, block, values, window, copies)
    n = sums.queries
    mean = (lambda total: total / n) if n else (lambda total: math.nan)
    return {
        "n_queries": n,
        "sink_mass": mean(sums.sink),
        "local_mass": mean(sums.local),
        "entropy": mean(sums.entropy),
        "entropy_normalized": mean(sums.entropy_normalized),
        "mean_distance": mean(sums.distance),
        "top1_position_histogram": sums.histogram.tolist(),
        "retrieval_score": sums.hits / sums.events if sums.events else math.nan,
        "retrieval_events": sums.events,
        "streaming_error": math.sqrt(sums.error_sq / sums.output_sq) if sums.output_sq > 0 else math.nan,
    }


@dataclass(frozen=True)
class Copies:
    """Per position ``p`` of a sequence: whether the token at ``p + 1`` (what the query at ``p``
    produced) copies a token present at or before ``p`` within the needle span (``event``), and
    the token ids, to check where the top-1 key landed."""

    event: np.ndarray  # (n,) bool
    ids: np.ndarray  # (n,) int64
    low: int
    high: int


def copy_events(tokens: list[int], needle: tuple[int, int] | None = None) -> Copies:
    """`Copies` of a token sequence, for the whole context or the ``needle`` span ``[low, high)``."""
    ids = np.asarray(tokens, np.int64)
    low, high = needle if needle is not None else (0, len(ids))
    first: dict[int, int] = {}
    for position in range(max(low, 0), min(high, len(ids))):
        first.setdefault(int(ids[position]), position)
    event = np.zeros(len(ids), bool)
    for p in range(len(ids) - 1):
        seen = first.get(int(ids[p + 1]))
        event[p] = seen is not None and seen <= p
    return Copies(event, ids, low, high)


def _add_block(
    sums: _Sums,
    spec: Any,
    block: attention_math.Attention,
    values: np.ndarray,
    window: int,
    copies: Copies | None,
) -> None:
    w = block.weights  # float32; sums below in float64
    p, j = block.query_positions, block.key_positions
    seen = attention_math.visible(spec, p, j)
    back = (p[:, None] - j[None, :]).astype(np.float32)
    sums.queries += w.shape[0]
    sums.sink += float(w[:, j < SINKS].sum(dtype=np.float64))
    sums.local += float(np.sum(w, where=seen & (back < LOCAL), dtype=np.float64))
    logs = np.log(w, where=w > 0, out=np.zeros_like(w))
    entropy = -np.einsum("ij,ij->i", w, logs, dtype=np.float64)
    sums.entropy += float(entropy.sum())
    count = seen.sum(axis=1)
    normalized = np.where(count > 1, entropy / np.log(np.maximum(count, 2)), 0.0)
    sums.entropy_normalized += float(normalized.sum())
    sums.distance += float(np.einsum("ij,ij->", w, back, dtype=np.float64))
    attends = count > 0
    top = j[np.argmax(w, axis=1)]
    sums.histogram += np.bincount(position_bins(top[attends]), minlength=POSITION_BINS)
    # Streaming: the same logits over sinks + recent keys only; a layer's own sinks (the
    # denominator's extra term) keep their share, 1 - sum(w).
    kept = np.where((j[None, :] < SINKS) | (back < window), w, np.float32(0))
    full = (w @ values).astype(np.float64)
    denominator = kept.sum(axis=1, dtype=np.float64) + np.clip(
        1.0 - w.sum(axis=1, dtype=np.float64), 0.0, None
    )
    streamed = (kept @ values) / np.where(denominator > 0, denominator, 1.0)[:, None]
    sums.error_sq += float(((streamed - full) ** 2).sum())
    sums.output_sq += float((full**2).sum())
    if copies is not None:
        inside = p < len(copies.event)
        event = np.zeros(len(p), bool)
        event[inside] = copies.event[p[inside]] & attends[inside]
        if event.any():
            at, where = p[event], top[event]
            produced = copies.ids[at + 1]
            hit = (
                (where >= copies.low)
                & (where < copies.high)
                & (where <= at)
                & (copies.ids[where] == produced)
            )
            sums.events += int(event.sum())
            sums.hits += int(hit.sum())


def attention_rows(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    *,
    seq: int = 0,
    window: int = WINDOW,
    needle: tuple[int, int] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """One row per (layer, query head) of a file with queries: ``file``, ``snapshot``, ``layer``,
    ``head`` (the query head), ``kv_head``, then `COLUMNS`."""
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        layers = layers_with_queries(snap)
        ids = token_ids(snap)
        tokens = copy_events(ids[seq], needle) if ids is not None and seq < len(ids) else None
        for layer in layers:
            spec = snap.layers[layer].queries
            assert spec is not None
            for head in range(spec.num_heads):
                scores = head_scores(snap, layer, head, seq=seq, window=window, needle=needle, tokens=tokens)
                yield {
                    "file": os.fspath(path),
                    "snapshot": snap.index,
                    "layer": layer,
                    "head": head,
                    "kv_head": spec.kv_heads[head],
                    **scores,
                }


def attention_stats(
    paths: str | os.PathLike[str] | list[str | os.PathLike[str]],
    snapshot: int = -1,
    *,
    window: int = WINDOW,
    needle: tuple[int, int] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """`attention_rows` of one or more files as a Polars DataFrame."""
    import polars as pl

    files = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    rows = [
        row
        for path in files
        for row in attention_rows(
            path, snapshot, window=window, needle=needle, storage_options=storage_options
        )
    ]
    return pl.DataFrame(rows, schema_overrides={"top1_position_histogram": pl.List(pl.Int64)})
