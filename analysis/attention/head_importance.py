"""Head importance from saved attention (format 1.3 files with queries): per (layer, query head),
the quantities the KV-compression literature reports, recomputed offline from the file.

Every score is a function of the attention weights SPEC 10.1 defines (`kvformat.attention`:
float32, the layer's recorded mask, scale, softcap and sinks), taken a block of queries at a time,
so memory is one block's ``(BLOCK, n_keys)`` map plus the head's K and V. The weights and scores
come from the compiled pass of `attention_kernel` (C, `native`),
or from `kvformat.attention.weights` and numpy where it is not built, the keys are out of
position order, or a block could overflow:

- ``sink_mass``: mean over queries of the weight on key positions ``< SINKS`` (StreamingLLM's
  attention sinks); ``local_mass``: on the visible keys less than ``LOCAL`` positions back,
  sinks excluded (the two never overlap: a pure sink head reads ``sink_mass`` 1, ``local_mass``
  0, however short the context).
- ``entropy`` (nats) of each query's weights, and ``entropy_normalized``: divided by the log of
  the number of keys the query sees (1 = uniform; queries that see one key count as 0).
- ``mean_distance``: query position minus key position, attention-weighted, averaged.
- ``top1_position_histogram``: the position of each query's most-attended key in the
  norm-by-position bins (`catalogue.position_bins`: 0, [1,2), [2,4), ...).
- ``retrieval_score`` (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
  Factuality"): over the decoding steps whose generated token (the token at position + 1) copies
  a token present earlier in the context (or in ``needle``, a ``[start, stop)`` span of
  positions), the fraction whose query's top-1 key holds that token; ``retrieval_events`` is how
  many such steps. By default only generated tokens count, as in the paper (the query at the
  prompt's last position produced the first one); ``retrieval="all"`` counts every stored query,
  the prompt window's too.
- ``queries_incomplete``: the head's queries left out of every score because they attended keys
  the file no longer holds (a windowed cache; `kvformat.attention.context_keys`).
- ``streaming_error`` (DuoAttention's question, without training): the relative error
  ``||o' - o|| / ||o||`` over all queries of the head's attention output when it may only see
  the first ``SINKS`` keys plus the last ``window`` positions (``o' `` renormalized over those).
  ``streaming_trivial`` flags a head none of whose scored queries sees a key outside that
  (every query before position ``SINKS + window``): its error is 0 by construction, and says
  nothing of the head.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvformat
from kvformat import attention as attention_math
from kvformat import pages
from kvformat.errors import InvalidArgumentError, UnknownNameError

from ..dependencies import pa, pl
from ..engine import parallel
from ..engine.files import FileFailure, describe_error, expand_paths
from ..errors import AnalysisError
from ..kernels import attention as attention_kernel
from ..kernels import attention as k
from ..kernels.arrays import float32_rows, work_matrix
from ..stats.arrow import arrow_table
from ..stats.catalogue import POSITION_BINS, position_bins
from .tokens import token_ids

SINKS = 4  # key positions counted as sinks
LOCAL = 64  # positions back that count as local
WINDOW = 256  # default recent window of `streaming_error`
FINITE = 1e30  # a bound on |logit| under which the compiled pass may assume finite logits

COLUMNS = (
    "n_queries",
    "queries_incomplete",
    "sink_mass",
    "local_mass",
    "entropy",
    "entropy_normalized",
    "mean_distance",
    "top1_position_histogram",
    "retrieval_score",
    "retrieval_events",
    "streaming_error",
    "streaming_trivial",
)


class NoQueriesError(AnalysisError, kvformat.errors.NoQueriesError):
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
    copies = tokens if isinstance(tokens, Copies) or tokens is None else copy_events(tokens, needle)
    return _scores(snap, layer, [head], spec.kv_heads[head], seq, window, copies)[0]


@dataclass(frozen=True)
class _Keys:
    """One KV head's keys and values as float32 ``(n_keys, dim)`` (views of the thread's work
    buffers for float16 and bfloat16: valid until the thread's next `_keys`), their positions,
    and whether those increase (as caches hold them; a rotating cache may not)."""

    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray
    ordered: bool
    largest: float  # the largest |k| (NaN when a key holds one)
    # (n,) increasing: the queries the keys were gathered for; (n,) bool: each saw all its keys
    query_positions: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    complete: np.ndarray = field(default_factory=lambda: np.empty(0, bool))
    # sparse attention (format 1.7): the layer's key selections, read once
    selection: kvformat.Selection | None = None

    def selection_at(self, positions: np.ndarray) -> np.ndarray | None:
        """The key selections (`kvformat.attention.selected_rows`) of queries at ``positions``
        ``(block, width)``, or None in a layer without selections."""
        return attention_math.rows_for(self.selection, positions)

    def complete_at(self, positions: np.ndarray) -> np.ndarray:
        """``(len(positions),)`` bool: `complete` of queries at ``positions`` (among those the
        keys were gathered for)."""
        return self.complete[np.searchsorted(self.query_positions, positions)]


def _keys(snap: kvformat.Snapshot, layer: int, kv_head: int, seq: int, query_positions: np.ndarray) -> _Keys:
    """The keys the queries at ``query_positions`` saw (`kvformat.attention.context_keys`: with a
    windowed layer's dropped rows from earlier snapshots), and which of the queries saw every one
    of their keys (``complete``)."""
    found = attention_math.context_keys(snap, layer, kv_head, seq, query_positions)
    positions = np.ascontiguousarray(found.positions, np.int64)
    # Into buffers the thread reuses (valid until its next `_keys`): fresh pages for every head
    # cost a new process page faults on every head.
    k = float32_rows(found.k, reuse=True, compiled=True, buffer="attention keys")
    return _Keys(
        k,
        float32_rows(found.v, reuse=True, compiled=True, buffer="attention values"),
        positions,
        bool(np.all(positions[1:] > positions[:-1])),
        float(np.maximum(k.max(initial=0.0), -k.min(initial=0.0))),  # NaN stays NaN
        np.asarray(query_positions, np.int64),
        found.complete,
        snap.selection(layer, seq),
    )


def _scores(
    snap: kvformat.Snapshot,
    layer: int,
    heads: Sequence[int],
    kv_head: int,
    seq: int,
    window: int,
    copies: Copies | None,
) -> list[dict[str, Any]]:
    """The scores of query heads ``heads`` (all reading ``kv_head``), in that order, over the
    queries that saw every one of their keys (the others are counted in ``queries_incomplete``).
    Where the heads' queries share their positions (as a capture saves them), the compiled pass
    takes their blocks stacked: one product per block for every head of the group."""
    spec = snap.layers[layer].queries
    assert spec is not None
    queries = [_queries(snap, layer, head, seq) for head in heads]
    keys = _keys(snap, layer, kv_head, seq, np.unique(np.concatenate([at for _, at in queries])))
    incomplete = [0] * len(heads)
    if not keys.complete.all():
        for i, (q, at) in enumerate(queries):
            complete = keys.complete_at(at)
            incomplete[i] = int((~complete).sum())
            queries[i] = (q[complete], at[complete])
    sums = [_Sums() for _ in heads]
    compiled = _compiled_available()
    if compiled and all(np.array_equal(at, queries[0][1]) for _, at in queries[1:]):
        _add_stacked(sums, spec, heads, queries, keys, window, copies)
    else:
        for head_sums, head, (q, at) in zip(sums, heads, queries, strict=True):
            _add_head(head_sums, spec, head, q, at, keys, window, copies, compiled)
    return [
        {
            **_columns(head_sums),
            "queries_incomplete": count,
            # no scored query sees a key past the sinks and the window: nothing is dropped
            "streaming_trivial": not at.size or int(at.max()) < SINKS + window,
        }
        for head_sums, count, (_, at) in zip(sums, incomplete, queries, strict=True)
    ]


def _queries(snap: kvformat.Snapshot, layer: int, head: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """Query head ``head``'s queries as float32 ``(n, dim)`` and their positions ``(n,)``."""
    found = snap.queries(layer, head, seq)
    assert found is not None
    return np.asarray(found.q, np.float32), found.positions


def _add_head(
    sums: _Sums,
    spec: Any,
    head: int,
    q: np.ndarray,
    positions: np.ndarray,
    keys: _Keys,
    window: int,
    copies: Copies | None,
    compiled: bool,
) -> None:
    """One head's queries ``q`` at ``positions``, a block at a time, alone: the compiled pass,
    or the numpy path where no compiled pass is there."""
    for start in range(0, q.shape[0], attention_math.BLOCK):
        rows = slice(start, start + attention_math.BLOCK)
        if compiled:
            _add_compiled([sums], spec, [head], q[rows], positions[rows], keys, window, copies)
        else:
            _add_block(sums, spec, head, q[rows], positions[rows], keys, window, copies)


WORK_BYTES = 64 << 20
"""The most bytes of one block's float32 weights (rows x keys) a thread holds: at 128k keys, a
block holds 128 rows."""


def _add_stacked(
    sums: list[_Sums],
    spec: Any,
    heads: Sequence[int],
    queries: list[tuple[np.ndarray, np.ndarray]],
    keys: _Keys,
    window: int,
    copies: Copies | None,
) -> None:
    """The heads' queries (``(q, positions)`` each, the same positions) through `_add_compiled`
    a block at a time, their rows stacked into this thread's work buffer: at most ``BLOCK``
    rows a block over all heads, and fewer where their weights would pass `WORK_BYTES`."""
    positions = queries[0][1]
    rows = min(attention_math.BLOCK, WORK_BYTES // (4 * max(1, keys.positions.size)))
    step = max(1, rows // len(heads))
    dim = queries[0][0].shape[1]
    for start in range(0, len(positions), step):
        at = positions[start : start + step]
        stacked = work_matrix("attention queries", len(heads) * len(at), dim)
        for i, (q, _) in enumerate(queries):
            stacked[i * len(at) : (i + 1) * len(at)] = q[start : start + step]
        _add_compiled(sums, spec, heads, stacked, at, keys, window, copies)


def _columns(sums: _Sums) -> dict[str, Any]:
    """A head's `COLUMNS` from its sums."""
    n = sums.queries
    mean = (lambda total: total / n) if n else (lambda total: math.nan)
    return {
        "n_queries": n,
        "queries_incomplete": 0,
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


def copy_events(tokens: list[int], needle: tuple[int, int] | None = None, start: int = 0) -> Copies:
    """`Copies` of a token sequence, for the whole context or the ``needle`` span ``[low, high)``;
    only queries at ``start`` or later count (the prompt's last position: generated tokens)."""
    ids = np.asarray(tokens, np.int64)
    low, high = needle if needle is not None else (0, len(ids))
    first: dict[int, int] = {}
    for position in range(max(low, 0), min(high, len(ids))):
        first.setdefault(int(ids[position]), position)
    event = np.zeros(len(ids), bool)
    for p in range(max(start, 0), len(ids) - 1):
        seen = first.get(int(ids[p + 1]))
        event[p] = seen is not None and seen <= p
    return Copies(event, ids, low, high)


def _compiled_available() -> bool:
    """Whether the compiled pass can run (imported only once attention is computed, so a
    ``kvsnap stats`` that never scores it does not pay)."""

    return bool(attention_kernel.AVAILABLE)


def block_rows(
    weights: np.ndarray,
    spec: Any,
    heads: Sequence[int],
    p: np.ndarray,
    key_positions: np.ndarray,
    window: int,
) -> np.ndarray:
    """`attention_kernel.block_scores` for each of ``heads``' blocks of ``weights`` (``len(p)``
    rows each, the raw products over ``key_positions``; exponentials after it): their rows of
    ``ROW_FIELDS`` sums, ``(len(heads) * len(p), ROW_FIELDS)``."""
    n = len(p)
    rows = np.empty((weights.shape[0], k.ROW_FIELDS))
    query_positions = np.ascontiguousarray(p, np.int64)
    key_positions = np.ascontiguousarray(key_positions, np.int64)
    for i, head in enumerate(heads):
        k.block_scores(
            weights[i * n : (i + 1) * n],
            rows[i * n : (i + 1) * n],
            query_positions,
            key_positions,
            float(spec.scale),
            float(spec.softcap or 0.0),
            -1 if spec.window is None else int(spec.window),
            int(spec.keep),
            float(spec.sinks[head]) if spec.sinks is not None else 0.0,
            spec.sinks is not None,
            SINKS,
            LOCAL,
            int(window),
        )
    return rows


def _add_compiled(
    sums: Sequence[_Sums],
    spec: Any,
    heads: Sequence[int],
    q: np.ndarray,
    p: np.ndarray,
    keys: _Keys,
    window: int,
    copies: Copies | None,
) -> None:
    """`_add_block` through `attention_kernel.block_scores` for the query heads ``heads`` of one
    KV head at once: ``q`` ``(len(heads) * n, dim)`` is their blocks at positions ``p`` ``(n,)``,
    stacked, so that each product is one call for the group; ``sums`` one per head. One pass over
    each row's logits. Only the columns a query of the block can see are multiplied, and the
    streaming output only over the columns it keeps. Keys out of position order (a rotating cache
    may hold them so), logits that could overflow or hold a NaN, or chunked attention, take the
    numpy path."""
    n = len(p)
    bound = float(np.abs(q).max(initial=0.0)) * keys.largest * q.shape[1] * float(spec.scale)
    # Keys out of order; NaN, inf or overflow possible; chunked or sparse attention (the C walk
    # knows windows, not blocks or selections): the numpy path, which applies SPEC 10.1's whole mask.
    if spec.chunk is not None or keys.selection is not None or not (keys.ordered and bound < FINITE):
        for i, (head_sums, head) in enumerate(zip(sums, heads, strict=True)):
            _add_block(head_sums, spec, head, q[i * n : (i + 1) * n], p, keys, window, copies)
        return
    positions = keys.positions
    end = int(np.searchsorted(positions, p.max(), "right"))
    # (len(q), end) float32: the raw products, each row's exponentials after the kernel. In a
    # buffer the thread reuses: fresh pages for every block cost page faults, which threads take
    # one at a time.
    weights = np.matmul(q, keys.k[:end].T, out=work_matrix("attention weights", len(q), end))

    rows = block_rows(weights, spec, heads, p, positions[:end], window)
    # The outputs are normalized after the products (``weights`` holds exponentials).
    inverse = rows[:, k.INVERSE, None]
    full = (weights @ keys.v[:end]) * inverse
    kept = np.zeros(full.shape)
    for low, high in _kept_columns(positions[:end], int(p.min()), window):
        j = positions[low:high]
        mask = np.tile((j[None, :] < SINKS) | (p[:, None] - j[None, :] < window), (len(heads), 1))
        kept += np.where(mask, weights[:, low:high], np.float32(0)) @ keys.v[low:high]
    kept *= inverse
    for i, head_sums in enumerate(sums):
        block = slice(i * n, (i + 1) * n)
        _add_rows(head_sums, rows[block], full[block], kept[block], p, positions, copies)


def _add_rows(
    sums: _Sums,
    rows: np.ndarray,
    full: np.ndarray,
    kept: np.ndarray,
    p: np.ndarray,
    positions: np.ndarray,
    copies: Copies | None,
) -> None:
    """One head's block into ``sums``: the kernel's ``rows`` ``(n, ROW_FIELDS)``, its attention
    output ``full`` and streaming output ``kept`` ``(n, dim)`` (both normalized by the full
    denominator), queries at ``p`` over keys at ``positions``."""

    sums.queries += len(p)
    sums.sink += float(rows[:, k.SINK].sum())
    sums.local += float(rows[:, k.LOCAL].sum())
    entropy, count = rows[:, k.ENTROPY], rows[:, k.VISIBLE]
    _add_entropy(sums, entropy, count)
    sums.distance += float(rows[:, k.DISTANCE].sum())
    _add_streaming(sums, full, kept, rows[:, k.KEPT] + rows[:, k.SINK_SHARE])
    _add_top(sums, p, positions[rows[:, k.TOP].astype(np.int64)], count > 0, copies)


def _kept_columns(positions: np.ndarray, first_query: int, window: int) -> list[tuple[int, int]]:
    """Column ranges ``[low, high)`` of ``positions`` (increasing) holding every key a streaming
    head keeps for queries at ``first_query`` or later: the sinks and the recent window."""
    sinks = int(np.searchsorted(positions, SINKS, "left"))
    recent = int(np.searchsorted(positions, first_query - window, "right"))
    if recent <= sinks:
        return [(0, len(positions))]
    return [(0, sinks), (recent, len(positions))]


def _add_entropy(sums: _Sums, entropy: np.ndarray, count: np.ndarray) -> None:
    """Per-query entropies ``(n,)`` (nats) and the visible key counts: the entropy sums, the
    normalized one divided by ``log(count)`` (0 for a query that sees at most one key)."""
    sums.entropy += float(entropy.sum())
    sums.entropy_normalized += float(np.where(count > 1, entropy / np.log(np.maximum(count, 2)), 0.0).sum())


def _add_streaming(sums: _Sums, full: np.ndarray, kept: np.ndarray, denominator: np.ndarray) -> None:
    """The streaming error's sums: the attention output ``full`` ``(n, dim)`` against the output
    over the kept weights, ``kept`` ``(n, dim)``, renormalized by ``denominator`` ``(n,)``."""
    streamed = kept / np.where(denominator > 0, denominator, 1.0)[:, None]
    sums.error_sq += float(((streamed - full) ** 2).sum())
    sums.output_sq += float((full**2).sum())


def _add_top(sums: _Sums, p: np.ndarray, top: np.ndarray, attends: np.ndarray, copies: Copies | None) -> None:
    """The top-1 histogram and the retrieval events and hits of queries at ``p`` whose most
    attended key positions are ``top`` (counted where ``attends``)."""
    sums.histogram += np.bincount(position_bins(top[attends]), minlength=POSITION_BINS)
    if copies is None:
        return
    inside = p < len(copies.event)
    event = np.zeros(len(p), bool)
    event[inside] = copies.event[p[inside]] & attends[inside]
    if event.any():
        at, where = p[event], top[event]
        produced = copies.ids[at + 1]
        hit = (where >= copies.low) & (where < copies.high) & (where <= at) & (copies.ids[where] == produced)
        sums.events += int(event.sum())
        sums.hits += int(hit.sum())


def _add_block(
    sums: _Sums,
    spec: Any,
    head: int,
    q: np.ndarray,
    p: np.ndarray,
    keys: _Keys,
    window: int,
    copies: Copies | None,
) -> None:
    """The numpy path (no compiled pass, keys out of position order, or logits that could overflow):
    the scores of queries ``q`` at ``p`` from `kvformat.attention.weights`."""
    j = keys.positions
    chosen = keys.selection_at(p)
    w = attention_math.weights(spec, head, q, keys.k, p, j, chosen)  # float32; sums below in float64
    seen = attention_math.visible(spec, p, j, chosen)
    back = (p[:, None] - j[None, :]).astype(np.float32)
    sums.queries += w.shape[0]
    sums.sink += float(w[:, j < SINKS].sum(dtype=np.float64))
    sums.local += float(np.sum(w, where=seen & (back < LOCAL) & (j >= SINKS), dtype=np.float64))
    logs = np.log(w, where=w > 0, out=np.zeros_like(w))
    entropy = -np.einsum("ij,ij->i", w, logs, dtype=np.float64)
    count = seen.sum(axis=1)
    _add_entropy(sums, entropy, count)
    sums.distance += float(np.einsum("ij,ij->", w, back, dtype=np.float64))
    # Streaming: the same logits over sinks + recent keys only; a layer's own sinks keep their
    # share of the denominator.
    kept = np.where((j[None, :] < SINKS) | (back < window), w, np.float32(0))
    denominator = kept.sum(axis=1, dtype=np.float64) + _sink_share(spec, head, q, keys.k, p, j, chosen)
    _add_streaming(sums, (w @ keys.v).astype(np.float64), kept @ keys.v, denominator)
    _add_top(sums, p, j[np.argmax(w, axis=1)], count > 0, copies)


def _sink_share(
    spec: Any,
    head: int,
    q: np.ndarray,
    k: np.ndarray,
    p: np.ndarray,
    j: np.ndarray,
    chosen: np.ndarray | None,
) -> np.ndarray:
    """``(n,)`` float64: the weight of the layer's own sink, ``exp(sink - m) / T`` in SPEC 10.1's
    terms (0 without sinks). Not ``1 - sum(w)``: that is float32 rounding where the share is small."""
    if spec.sinks is None:
        return np.zeros(len(p))
    logits = (np.asarray(q, np.float64) @ np.asarray(k, np.float64).T) * spec.scale
    if spec.softcap is not None:
        logits = spec.softcap * np.tanh(logits / spec.softcap)
    logits = np.where(attention_math.visible(spec, p, j, chosen), logits, -np.inf)
    sink = float(spec.sinks[head])
    top = np.maximum(logits.max(axis=1, initial=-np.inf), sink)
    with np.errstate(invalid="ignore"):
        share = np.exp(sink - top) / (np.exp(logits - top[:, None]).sum(axis=1) + np.exp(sink - top))
    return np.where(np.isfinite(share), share, 0.0)


RETRIEVAL = ("generated", "all")
"""Which queries ``retrieval_score`` counts: those whose next token the model generated (Wu et
al. 2024 count decoding steps), or every stored query (the prompt window's too)."""


class AttentionWarning(UserWarning):
    """A result left out or flagged: queries whose keys the file no longer holds, a retrieval
    score that cannot be scoped."""


def prompt_end(snap: kvformat.Snapshot) -> int | None:
    """The first position after the prompt, from the capture's metadata (None if not recorded)."""
    meta = snap.metadata
    if "prompt_tokens" not in meta:
        return None
    return int(meta.get("resumed_from_tokens", 0) or 0) + int(meta["prompt_tokens"])


def check_needle(needle: tuple[int, int] | None, count: int, name: str) -> None:
    """ValueError for a ``needle`` span ``[low, high)`` not inside the ``count`` positions whose
    tokens the file records."""
    if needle is None:
        return
    low, high = needle
    if not 0 <= low < high <= count:
        raise InvalidArgumentError(
            f"--needle {low}:{high} is not inside the {count} positions whose tokens {name} records "
            f"(0:{count})"
        )


def _copies(
    snap: kvformat.Snapshot, seq: int, needle: tuple[int, int] | None, retrieval: str
) -> Copies | None:
    """The copy events ``retrieval_score`` counts (None without recorded tokens, or when
    ``retrieval="generated"`` and the file records no prompt length: the score is then NaN)."""
    if retrieval not in RETRIEVAL:
        raise UnknownNameError(f"retrieval must be one of {', '.join(RETRIEVAL)}, not {retrieval!r}")
    ids = token_ids(snap)
    if ids is None or seq >= len(ids):
        if needle is not None:
            raise InvalidArgumentError(f"--needle needs the token ids, which {snap.name} does not record")
        return None
    check_needle(needle, len(ids[seq]), snap.name)
    first = 0
    if retrieval == "generated":
        end = prompt_end(snap)
        if end is None:
            warnings.warn(
                f"{snap.name} records no prompt length: retrieval_score over generated tokens is left "
                "NaN (--retrieval all counts every stored query)",
                AttentionWarning,
                stacklevel=3,
            )
            return None
        first = end - 1  # the query at the prompt's last position produced the first generated token
    return copy_events(ids[seq], needle, start=first)


def attention_rows(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    *,
    seq: int = 0,
    window: int = WINDOW,
    needle: tuple[int, int] | None = None,
    retrieval: str = "generated",
    storage_options: dict[str, Any] | None = None,
    threads: int | None = None,
) -> Iterator[dict[str, Any]]:
    """One row per (layer, query head) of a file with queries: ``file``, ``snapshot``, ``layer``,
    ``head`` (the query head), ``kv_head``, then `COLUMNS`. Layers are scored on ``threads``
    threads (default one per core; BLAS single-threaded; the results do not depend on the thread
    count; each thread holds one KV head's keys, values and weights), rows in order.

    Queries that attended keys the file no longer holds (a windowed cache snapshotted after they
    left the window) are left out of every score and counted in ``queries_incomplete``, with one
    `AttentionWarning` per file. ``retrieval``: see `RETRIEVAL`."""
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        layers = layers_with_queries(snap)
        tokens = _copies(snap, seq, needle, retrieval)

        def layer_rows(layer: int) -> list[dict[str, Any]]:
            spec = snap.layers[layer].queries
            assert spec is not None
            rows: dict[int, dict[str, Any]] = {}
            for kv_head in dict.fromkeys(spec.kv_heads):  # a KV head's keys read once for its group
                group = [head for head in range(spec.num_heads) if spec.kv_heads[head] == kv_head]
                scored = _scores(snap, layer, group, kv_head, seq, window, tokens)
                # this KV head's pages leave the process: a pass over a file larger than memory
                # keeps a bounded resident set (the views stay valid; the pages fault back in)
                pages.of(snap).release(snap._segments.of_head(layer, seq, kv_head))
                for head, scores in zip(group, scored, strict=True):
                    rows[head] = {
                        "file": os.fspath(path),
                        "snapshot": snap.index,
                        "layer": layer,
                        "head": head,
                        "kv_head": kv_head,
                        **scores,
                    }
            return [rows[head] for head in sorted(rows)]

        incomplete = heads = 0
        for rows in _each_layer(layer_rows, layers, threads):
            for row in rows:
                incomplete += row["queries_incomplete"]
                heads += row["queries_incomplete"] > 0
                yield row
        if incomplete:
            warnings.warn(
                f"{snap.name}: {incomplete} queries of {heads} query heads left out of the attention "
                "statistics: they attended keys no snapshot of the file holds (a windowed cache; "
                "column queries_incomplete)",
                AttentionWarning,
                stacklevel=2,
            )


def _each_layer(
    layer_rows: Any, layers: list[int], threads: int | None = None
) -> Iterator[list[dict[str, Any]]]:
    """``layer_rows(layer)`` of each layer in order, on ``threads`` threads (default one per core;
    BLAS single-threaded) where there are several."""
    threads = min(threads or parallel.cores(), len(layers))
    if threads <= 1:
        for layer in layers:
            yield layer_rows(layer)
        return
    with parallel.single_threaded_blas(), ThreadPoolExecutor(threads) as pool:
        yield from pool.map(layer_rows, layers)


def attention_stats(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    snapshot: int = -1,
    *,
    window: int = WINDOW,
    needle: tuple[int, int] | None = None,
    retrieval: str = "generated",
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """`attention_rows` of one or more files as a Polars DataFrame."""

    frame = pl.from_arrow(
        attention_table(
            paths,
            snapshot,
            window=window,
            needle=needle,
            retrieval=retrieval,
            storage_options=storage_options,
        )
    )
    assert isinstance(frame, pl.DataFrame)
    return frame


def attention_table(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    snapshot: int = -1,
    *,
    window: int = WINDOW,
    needle: tuple[int, int] | None = None,
    retrieval: str = "generated",
    storage_options: dict[str, Any] | None = None,
    failures: list[FileFailure] | None = None,
) -> Any:
    """`attention_rows` of one or more files or patterns (``runs/*.kv``, ``s3://bucket/*.kv``,
    as `head_stats` takes them) as an Arrow table (what ``kvsnap stats --stats attention`` prints
    and saves, without importing polars: `python -m benchmarks.cli_bench` times the difference).

    A file that fails (truncated, without queries, without the snapshot asked for) raises its
    error; given a ``failures`` list, it is appended there instead (`FileFailure`, naming the
    file) and the other files go on."""

    patterns = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    files = expand_paths([os.fspath(p) for p in patterns], storage_options)
    rows: list[dict[str, Any]] = []
    for path in files:
        try:
            found = attention_rows(path, snapshot, window=window, needle=needle, retrieval=retrieval,
                                   storage_options=storage_options)  # fmt: skip
            rows += found
        except (kvformat.KVSnapError, OSError) as exc:
            if failures is None:
                raise
            failures.append(FileFailure(path, describe_error(exc)))
    if rows:  # from numpy buffers: `pa.Table.from_pylist` imports pandas
        return arrow_table(rows)
    types = {
        "file": pa.string(),
        "top1_position_histogram": pa.list_(pa.int64()),
        "streaming_trivial": pa.bool_(),
    }
    integers = ("snapshot", "layer", "head", "kv_head", "n_queries", "queries_incomplete", "retrieval_events")
    names = ("file", "snapshot", "layer", "head", "kv_head", *COLUMNS)
    schema = pa.schema([(n, types.get(n, pa.int64() if n in integers else pa.float64())) for n in names])
    return schema.empty_table()
