"""Attention recomputed offline from a snapshot's queries, keys and values (format 1.3), as the
model computed it: SPEC section 10.1 defines the arithmetic a layer's ``queries`` object records.

For a query ``q`` at position ``p`` of query head ``h`` (reading KV head ``kv_heads[h]``):

    logit_j = scale * (q . k_j)                      for every key position j the snapshot holds
    logit_j = softcap * tanh(logit_j / softcap)      when softcap is set
    visible_j = j <= p  and  (window is null  or  p - j < window - keep  or  j < keep)
                       and  (chunk is null   or  j // chunk == p // chunk)
                       and  (the layer has no selection row at p  or  j is in that row)
    weight_j = exp(logit_j - m) / (sum_visible exp(logit - m) + [exp(sink_h - m)])

with ``m`` the largest visible logit (and the sink's, when the layer has sinks). Everything is
float32, as the attention kernels compute it. Masked keys get weight exactly 0. Queries are
taken a block at a time (`BLOCK`), so memory is ``BLOCK x n_keys`` floats however many queries
there are; `attention` returns the full ``(n_queries, n_keys)`` map only because it was asked
for (`blocks` streams it).

A layer whose queries read pooled keys (format 1.8, DeepSeek-V4.1's compressed attention,
``pooled``) takes, beside its own visible keys, the pooled layer's rows ``g`` with ``(g + 1) *
ratio <= p + 1``, those of the query's selection row where it has one (the row then names pooled
keys only), in the same softmax: their columns follow the layer's own (`Attention.pooled_keys`).

The keys used are those each query saw (`context_keys`): the ones the selected snapshot holds
and, for a sliding-window or rotating layer whose window has since moved on, the rows the
snapshot dropped, taken from the snapshots it descends from (a series keeps them in the file). A
query that saw a key no snapshot holds (the window moved past it between two snapshots) cannot
be recomputed exactly: `attention` refuses it (`MissingKeysError`), and the statistics leave it
out and count it; it is never renormalised over fewer keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvformat.errors import (
    InvalidArgumentError,
    MissingKeysError,
    NoQueriesError,
    OutOfRangeError,
    PooledKeysError,
)
from kvformat.runs import ranges

if TYPE_CHECKING:
    from kvformat.manifest import LayerSpec, Pooled, QuerySpec
    from kvformat.pages import Head
    from kvformat.queries import Queries, Selection


class Snapshot(Protocol):
    """What the attention maths reads of a snapshot (`kvformat.Snapshot` is one): its layers,
    heads, queries, and the rows of dropped positions its ancestors hold."""

    @property
    def name(self) -> str: ...

    @property
    def layers(self) -> Sequence[LayerSpec]: ...

    @property
    def num_layers(self) -> int: ...

    def head(
        self,
        layer: int,
        head: int,
        seq: int = 0,
        positions: tuple[int, int] | range | None = None,
        *,
        tokens: tuple[int, int] | range | None = None,
        values: bool = True,
    ) -> Head | None: ...

    def queries(
        self, layer: int, head: int, seq: int = 0, positions: tuple[int, int] | range | None = None
    ) -> Queries | None: ...

    def selection(
        self, layer: int, seq: int = 0, positions: tuple[int, int] | range | None = None
    ) -> Selection | None: ...

    def _dropped_rows(self, layer: int, head: int, seq: int, positions: np.ndarray) -> Head: ...


BLOCK = 256
"""Queries per block: at 8192 keys a block's logits are 8 MiB of float32."""


@dataclass(frozen=True)
class Attention:
    """Softmax weights of one query head: ``weights`` ``(n_queries, n_keys)`` float32 (rows sum
    to 1 over the visible keys, masked keys exactly 0; with sinks, to 1 minus the sink's share),
    ``query_positions`` ``(n_queries,)``, ``key_positions`` ``(n_keys,)``."""

    layer: int
    head: int
    seq: int
    weights: np.ndarray
    query_positions: np.ndarray
    key_positions: np.ndarray
    pooled_keys: int = 0  # the last columns: the pooled layer's keys, at their group positions


def _spans(spec: QuerySpec, query_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(sink_stop, recent_start, stop)`` ``(n,)`` int64 each: the query at ``p`` sees key
    positions ``[0, sink_stop)`` and ``[recent_start, stop)`` (SPEC 10.1's mask as spans)."""
    p = np.asarray(query_positions, np.int64)
    stop = p + 1
    if spec.chunk is not None:  # 1.6: the query's own block of `chunk` positions (never with a window)
        return np.zeros_like(p), (p // int(spec.chunk)) * int(spec.chunk), stop
    if spec.window is None:
        return np.zeros_like(p), np.zeros_like(p), stop
    recent = int(spec.window) - int(spec.keep)
    sink_stop = np.minimum(np.int64(spec.keep), stop)
    recent_start = np.maximum(p - recent + 1, 0) if recent > 0 else stop
    return sink_stop, recent_start, stop


def seen_positions(spec: QuerySpec, query_positions: np.ndarray) -> np.ndarray:
    """The key positions ``(m,)`` int64, increasing, that at least one of the queries at
    ``query_positions`` attends under SPEC 10.1's mask."""
    if not len(query_positions):
        return np.empty(0, np.int64)
    sink_stop, recent_start, stop = _spans(spec, query_positions)
    starts = np.concatenate([np.zeros_like(sink_stop), recent_start])
    stops = np.concatenate([sink_stop, stop])
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    reach = np.maximum.accumulate(stops)
    new = np.ones(starts.size, bool)
    new[1:] = starts[1:] > reach[:-1]  # a span that starts past everything before it
    first = np.flatnonzero(new)
    last = np.append(first[1:], starts.size) - 1
    return ranges(starts[first], reach[last] - starts[first])


def complete_queries(spec: QuerySpec, query_positions: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """``(n,)`` bool: which queries see none of the ``missing`` key positions (increasing)."""
    sink_stop, recent_start, stop = _spans(spec, query_positions)

    def count(low: np.ndarray, high: np.ndarray) -> np.ndarray:
        found = np.searchsorted(missing, high) - np.searchsorted(missing, low)
        return np.where(high > low, found, 0)

    return (count(np.zeros_like(sink_stop), sink_stop) + count(recent_start, stop)) == 0


@dataclass(frozen=True)
class ContextKeys:
    """The keys and values a group of queries saw: ``k`` ``(n_keys, k_dim)``, ``v``
    ``(n_keys, v_dim)`` in the file's dtype, their ``positions`` ``(n_keys,)`` (increasing), and
    ``complete`` ``(n_queries,)`` bool: whether every key the query saw is among them.
    ``pooled``: the last so many are the pooled layer's keys (format 1.8), at group positions."""

    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray
    complete: np.ndarray
    pooled: int = 0


def refuse_pooled(spec: QuerySpec | None, layer: int | None) -> None:
    """`PooledKeysError` for a layer (``layer``; None: not known here) whose queries read pooled
    keys (format 1.8): a computation over its own keys alone would leave them out of the softmax."""
    if spec is not None and spec.pooled is not None:
        which = "a layer's queries" if layer is None else f"layer {layer}'s queries"
        raise PooledKeysError(
            f"{which} also read layer {spec.pooled.layer}'s pooled keys (format 1.8, "
            "DeepSeek-V4.1's compressed attention), which this computation does not take: "
            "Snapshot.attention and Snapshot.attention_output compute its attention"
        )


def context_keys(
    snap: Snapshot,
    layer: int,
    kv_head: int,
    seq: int,
    query_positions: np.ndarray,
    *,
    values: bool = True,
    pooled: bool = False,
) -> ContextKeys:
    """The keys of ``kv_head`` the queries at ``query_positions`` attended: those the snapshot
    holds plus, for positions it no longer holds (a window that moved on), the rows the snapshots
    it descends from hold. A query that saw a key found nowhere is marked incomplete.
    ``values=False``: the keys alone (``v`` empty; a latent layer's values are part of its keys,
    so they are read there). ``pooled``: a layer reading pooled keys (1.8) has them appended
    (`ContextKeys.pooled`); without it such a layer is refused (`refuse_pooled`)."""
    spec = snap.layers[layer].queries
    assert spec is not None
    if not pooled:
        refuse_pooled(spec, layer)
    kv = (
        snap.head(layer, kv_head, seq)
        if values or spec.latent
        else snap.head(layer, kv_head, seq, values=False)
    )
    assert kv is not None
    k, v, positions = kv.k, kv.v, kv.positions
    missing = np.setdiff1d(seen_positions(spec, query_positions), positions, assume_unique=True)
    if missing.size:
        earlier = snap._dropped_rows(layer, kv_head, seq, missing)
        if earlier.positions.size:
            order = np.argsort(np.concatenate([positions, earlier.positions]), kind="stable")
            k = np.concatenate([k, earlier.k])[order]
            v = np.concatenate([v, earlier.v])[order] if v.shape[0] else v
            positions = np.concatenate([positions, earlier.positions])[order]
            missing = np.setdiff1d(missing, earlier.positions, assume_unique=True)
    complete = complete_queries(spec, query_positions, missing)
    if spec.latent:  # 1.6: keys [latent; RoPE key], values the latent (SPEC 10.1)
        return ContextKeys(np.concatenate([k, v], axis=1), k, positions, complete)
    own = ContextKeys(k, v, positions, complete)
    if spec.pooled is not None:
        return _with_pooled(snap, spec.pooled, (kv_head, seq), query_positions, own, values)
    return own


def _with_pooled(
    snap: Snapshot,
    pooled: Pooled,
    where: tuple[int, int],
    query_positions: np.ndarray,
    own: ContextKeys,
    values: bool,
) -> ContextKeys:
    """``own`` keys followed by the pooled layer's (format 1.8): every row the snapshot holds of
    KV head and sequence ``where``; a query whose whole groups are not all among them (groups
    ``0 .. (p + 1) // ratio - 1``) is incomplete."""
    kv_head, seq = where
    found = snap.head(pooled.layer, kv_head, seq, values=values)
    assert found is not None  # a present layer (the manifest's rule)
    groups = (np.asarray(query_positions, np.int64) + 1) // pooled.ratio
    # Held positions are distinct and increasing from 0: groups 0 .. n-1 are all held where n of
    # them lie below n.
    held = np.searchsorted(found.positions, groups) == groups
    return ContextKeys(
        np.concatenate([own.k, found.k]),
        np.concatenate([own.v, found.v]) if values else own.v,
        np.concatenate([own.positions, found.positions]),
        own.complete & held,
        pooled=int(found.positions.size),
    )


def _spans_text(positions: np.ndarray) -> str:
    """``3..7, 12`` for increasing positions (at most three spans named)."""
    if not positions.size:
        return "none"
    breaks = np.flatnonzero(np.diff(positions) != 1)
    starts = np.concatenate([positions[:1], positions[breaks + 1]])
    ends = np.concatenate([positions[breaks], positions[-1:]])
    parts = [f"{a}..{b}" if b > a else f"{a}" for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    return ", ".join(parts[:3]) + (f" (+{len(parts) - 3} more)" if len(parts) > 3 else "")


def refuse_incomplete(
    snap: Snapshot, layer: int, head: int, positions: np.ndarray, complete: np.ndarray
) -> None:
    """`MissingKeysError` naming the queries of ``positions`` that are not ``complete``."""
    if complete.all():
        return
    bad, good = positions[~complete], positions[complete]
    raise MissingKeysError(
        f"{snap.name}, layer {layer}, query head {head}: the queries at positions {_spans_text(bad)} "
        f"({bad.size} of {positions.size}) attended keys that no snapshot of the file holds (the window "
        "moved past them before a snapshot was taken); recomputable: "
        f"{_spans_text(good)} (queries=(start, stop)), or capture with a smaller --every"
    )


def selected_rows(snap: Snapshot, layer: int, seq: int, query_positions: np.ndarray) -> np.ndarray | None:
    """The key selections of the queries at ``query_positions`` (format 1.7) as `visible` takes
    them: ``(n_queries, width)`` int64, a row of -1 where a query has none (it attends every
    visible key); None for a layer without selections."""
    return rows_for(snap.selection(layer, seq), query_positions)


def rows_for(found: Selection | None, query_positions: np.ndarray) -> np.ndarray | None:
    """`selected_rows` from a layer's `Selection` (``found``; None: the layer has none): callers
    that go over a head's queries a block at a time read the selection once and take each
    block's rows here (``(block, width)`` int64, not every query's at once)."""
    if found is None:
        return None
    out = np.full((query_positions.size, found.rows.shape[1]), -1, np.int64)
    at = np.searchsorted(found.positions, query_positions)
    inside = at < found.positions.size
    has = np.zeros(query_positions.size, bool)
    has[inside] = found.positions[at[inside]] == query_positions[inside]
    out[has] = found.rows[at[has]]
    return out


def _selected(selection: np.ndarray, key_positions: np.ndarray) -> np.ndarray:
    """``(n_queries, n_keys)`` bool: the keys each query's selection row names (every key for a
    row of -1: no selection)."""
    n, m = selection.shape[0], key_positions.size
    out = np.zeros((n, m), bool)
    out[selection[:, 0] < 0] = True
    if not m:
        return out
    at = np.minimum(np.searchsorted(key_positions, selection), m - 1)
    hit = (selection >= 0) & (key_positions[at] == selection)
    rows = np.broadcast_to(np.arange(n)[:, None], selection.shape)
    out[rows[hit], at[hit]] = True
    return out


def visible(
    spec: QuerySpec,
    query_positions: np.ndarray,
    key_positions: np.ndarray,
    selection: np.ndarray | None = None,
    pooled: int | None = None,
) -> np.ndarray:
    """``(n_queries, n_keys)`` bool: which keys each query attends (SPEC 10.1's mask);
    ``selection``: the queries' `selected_rows` in a layer with key selections (1.7).
    ``pooled``: for a layer reading pooled keys (1.8), how many of the last keys are the pooled
    layer's (`ContextKeys.pooled`); such a layer without it is refused (`refuse_pooled`)."""
    if spec.pooled is not None and pooled is None:
        refuse_pooled(spec, None)
    own = key_positions.size - (pooled or 0)
    p = query_positions[:, None]
    j = key_positions[None, :own]
    mask = j <= p
    if spec.window is not None:
        mask &= (p - j < spec.window - spec.keep) | (j < spec.keep)
    if spec.chunk is not None:
        mask &= j // spec.chunk == p // spec.chunk
    if spec.pooled is None:
        if selection is not None:
            mask &= _selected(selection, key_positions)
        return mask
    # 1.8: a pooled key g once its group is whole; a selection row names pooled keys only.
    groups = key_positions[own:]
    seen = (groups[None, :] + 1) * spec.pooled.ratio <= p + 1
    if selection is not None:
        seen &= _selected(selection, groups)
    return np.concatenate([mask, seen], axis=1)


def weights(
    spec: QuerySpec,
    head: int,
    q: np.ndarray,
    k: np.ndarray,
    query_positions: np.ndarray,
    key_positions: np.ndarray,
    selection: np.ndarray | None = None,
    pooled: int | None = None,
) -> np.ndarray:
    """The softmax weights ``(n_queries, n_keys)`` float32 of queries ``q`` ``(n, dim)`` over
    keys ``k`` ``(m, dim)`` for query head ``head`` (SPEC 10.1): `softmax` of `logits`."""
    return softmax(spec, head, logits(spec, q, k, query_positions, key_positions, selection, pooled))


def logits(
    spec: QuerySpec,
    q: np.ndarray,
    k: np.ndarray,
    query_positions: np.ndarray,
    key_positions: np.ndarray,
    selection: np.ndarray | None = None,
    pooled: int | None = None,
) -> np.ndarray:
    """``(n_queries, n_keys)`` float32: ``cap * tanh(q k^T * scale / cap)`` (without a softcap,
    ``q k^T * scale``), -inf where the query does not see the key (SPEC 10.1's mask). A column
    subset of it is the logits of that subset of keys."""
    # In place, one (n, m) float32 buffer: the same operations in the same order as the
    # expression above, so the same bits, at a few passes over memory instead of a dozen.
    out = np.asarray(q, np.float32) @ np.asarray(k, np.float32).T
    out *= np.float32(spec.scale)
    if spec.softcap is not None:
        cap = np.float32(spec.softcap)
        out /= cap
        np.tanh(out, out=out)
        out *= cap
    np.putmask(out, ~visible(spec, query_positions, key_positions, selection, pooled), np.float32(-np.inf))
    return out


def softmax(spec: QuerySpec, head: int, logits: np.ndarray) -> np.ndarray:
    """`logits` ``(n, m)`` float32 made the weights of query head ``head``, in place (and
    returned): each row's softmax, with the head's attention sink in the denominator where the
    layer has sinks; a row that sees nothing is all zeros."""
    top = logits.max(axis=1, initial=np.float32(-np.inf), keepdims=True)
    sink = None
    if spec.sinks is not None:
        sink = np.float32(spec.sinks[head])
        top = np.maximum(top, sink)
    top = np.where(np.isfinite(top), top, np.float32(0))  # a query that sees nothing: all zeros
    logits -= top  # a masked key stays -inf, so exp gives it exactly 0
    with np.errstate(under="ignore"):
        np.exp(logits, out=logits)
    total = logits.sum(axis=1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - top)
    positive = total > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        logits /= np.where(positive, total, np.float32(1))
    logits[~positive[:, 0]] = 0  # nothing seen, or a non-finite total: all zeros
    return logits


def _inputs(
    snap: Snapshot, layer: int, head: int, seq: int, queries: tuple[int, int] | range | None
) -> tuple[QuerySpec, np.ndarray, np.ndarray, ContextKeys, Selection | None]:
    """The layer's queries description, the head's queries and positions, its KV head's keys,
    values and positions (the keys those queries saw, `context_keys`, pooled keys included;
    `MissingKeysError` for queries that saw a key the file no longer holds), and the layer's key
    selections (`rows_for` gives a block's)."""
    if not isinstance(layer, int) or not 0 <= layer < snap.num_layers:
        raise OutOfRangeError(f"layer {layer} out of range 0..{snap.num_layers - 1}")
    spec = snap.layers[layer].queries
    found = snap.queries(layer, head, seq, positions=queries)
    if spec is None or found is None:
        raise NoQueriesError(f"layer {layer} holds no queries")
    keys = context_keys(snap, layer, spec.kv_heads[head], seq, found.positions, pooled=True)
    refuse_incomplete(snap, layer, head, found.positions, keys.complete)
    return spec, found.q, found.positions, keys, snap.selection(layer, seq)


def check_selection(
    snap: Snapshot,
    layer: int,
    head: int,
    *,
    queries: tuple[int, int] | range | None = None,
    keys: tuple[int, int] | range | None = None,
    seq: int = 0,
) -> None:
    """`OutOfRangeError` naming what the file stores where ``queries`` or ``keys`` (``[start,
    stop)`` positions) select none of query head ``head``'s stored queries or its KV head's keys."""
    if not isinstance(layer, int) or not 0 <= layer < snap.num_layers:
        raise OutOfRangeError(f"layer {layer} out of range 0..{snap.num_layers - 1}")
    found = snap.queries(layer, head, seq)
    spec = snap.layers[layer].queries
    if found is None or spec is None:
        raise NoQueriesError(f"layer {layer} holds no queries")
    chosen = _within(queries, found.positions)
    if queries is not None and not found.positions[chosen].size:
        raise OutOfRangeError(
            f"--queries {_span_text(queries)} selects none of the queries layer {layer} stores for query "
            f"head {head} (positions {_spans_text(found.positions)})"
        )
    if keys is not None:
        _keys_of_own(spec, layer)
        held = context_keys(snap, layer, spec.kv_heads[head], seq, found.positions[chosen]).positions
        if not held[_within(keys, held)].size:
            raise OutOfRangeError(
                f"--keys {_span_text(keys)} selects none of the keys these queries attend "
                f"(positions {_spans_text(held)})"
            )


def _keys_of_own(spec: QuerySpec, layer: int) -> None:
    """`InvalidArgumentError`: ``keys=(start, stop)`` selects key positions, which a layer that
    also reads pooled keys (format 1.8) has in two kinds."""
    if spec.pooled is not None:
        raise InvalidArgumentError(
            f"layer {layer} also reads pooled keys (format 1.8): keys=(start, stop) is not defined there; "
            "take the columns from Attention.key_positions and Attention.pooled_keys"
        )


def _span_text(span: tuple[int, int] | range) -> str:
    low, high = (span.start, span.stop) if isinstance(span, range) else span
    return f"{low}:{high}"


def _within(span: tuple[int, int] | range | None, positions: np.ndarray) -> np.ndarray | slice:
    """Which of ``positions`` lie in ``span`` (``[start, stop)``; everything for None)."""
    if span is None:
        return slice(None)
    low, high = (span.start, span.stop) if isinstance(span, range) else span
    return (positions >= int(low)) & (positions < int(high))


def blocks(
    snap: Snapshot,
    layer: int,
    head: int,
    *,
    queries: tuple[int, int] | range | None = None,
    keys: tuple[int, int] | range | None = None,
    seq: int = 0,
    block: int = BLOCK,
) -> Iterator[Attention]:
    """`attention` a block of ``block`` queries at a time (memory: one block's map)."""
    spec, q, q_positions, context, selection = _inputs(snap, layer, head, seq, queries)
    if keys is not None:
        _keys_of_own(spec, layer)
    k_positions, pooled = context.positions, context.pooled
    columns = _within(keys, k_positions)
    for start in range(0, q.shape[0], block):
        rows = slice(start, start + block)
        chosen = rows_for(selection, q_positions[rows])
        found = weights(spec, head, q[rows], context.k, q_positions[rows], k_positions, chosen, pooled)
        yield Attention(layer, head, seq, found[:, columns], q_positions[rows], k_positions[columns], pooled)


def attention(
    snap: Snapshot,
    layer: int,
    head: int,
    *,
    queries: tuple[int, int] | range | None = None,
    keys: tuple[int, int] | range | None = None,
    seq: int = 0,
) -> Attention:
    """The attention weights of query head ``head`` of ``layer`` for the snapshot's queries at
    positions ``queries`` (``(start, stop)``, default all) over its keys (normalized over every
    visible key; ``keys=(start, stop)`` returns only those columns). A layer reading pooled keys
    (1.8) has their columns last (`Attention.pooled_keys`)."""
    parts = list(blocks(snap, layer, head, queries=queries, keys=keys, seq=seq))
    if not parts:
        spec = snap.layers[layer].queries
        kv = snap.head(layer, spec.kv_heads[head] if spec else 0, seq)
        positions = kv.positions if kv is not None else np.empty(0, np.int64)
        positions = positions[_within(keys, positions)]
        empty = np.empty((0, positions.size), np.float32)
        return Attention(layer, head, seq, empty, np.empty(0, np.int64), positions)
    return Attention(
        layer,
        head,
        seq,
        np.concatenate([p.weights for p in parts]),
        np.concatenate([p.query_positions for p in parts]),
        parts[0].key_positions,
        parts[0].pooled_keys,
    )


def attention_output(
    snap: Snapshot,
    layer: int,
    head: int,
    *,
    queries: tuple[int, int] | range | None = None,
    seq: int = 0,
    block: int = BLOCK,
) -> tuple[np.ndarray, np.ndarray]:
    """``(output, positions)``: the attention output ``weights @ V`` ``(n_queries, v_dim)``
    float32 of query head ``head`` (what the kernel returned for it, before the output
    projection), a block of queries at a time."""
    spec, q, q_positions, context, selection = _inputs(snap, layer, head, seq, queries)
    values = np.asarray(context.v, np.float32)
    out = np.empty((q.shape[0], values.shape[1]), np.float32)
    for start in range(0, q.shape[0], block):
        rows = slice(start, start + block)
        at, chosen = q_positions[rows], rows_for(selection, q_positions[rows])
        found = weights(spec, head, q[rows], context.k, at, context.positions, chosen, context.pooled)
        out[rows] = found @ values
    return out, q_positions
