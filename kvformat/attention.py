"""Attention recomputed offline from a snapshot's queries, keys and values (format 1.3), as the
model computed it: SPEC section 10.1 defines the arithmetic a layer's ``queries`` object records.

For a query ``q`` at position ``p`` of query head ``h`` (reading KV head ``kv_heads[h]``):

    logit_j = scale * (q . k_j)                      for every key position j the snapshot holds
    logit_j = softcap * tanh(logit_j / softcap)      when softcap is set
    visible_j = j <= p  and  (window is null  or  p - j < window - keep  or  j < keep)
    weight_j = exp(logit_j - m) / (sum_visible exp(logit - m) + [exp(sink_h - m)])

with ``m`` the largest visible logit (and the sink's, when the layer has sinks). Everything is
float32, as the attention kernels compute it. Masked keys get weight exactly 0. Queries are
taken a block at a time (`BLOCK`), so memory is ``BLOCK x n_keys`` floats however many queries
there are; `attention` returns the full ``(n_queries, n_keys)`` map only because it was asked
for (`blocks` streams it).

The keys used are those the selected snapshot holds. In a series, a query of a sliding-window or
rotating layer saw the window of its own step; select the snapshot taken at that step (or any
snapshot still holding the window) to recompute it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvformat.manifest import QuerySpec
    from kvformat.reader import Snapshot

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


def visible(spec: QuerySpec, query_positions: np.ndarray, key_positions: np.ndarray) -> np.ndarray:
    """``(n_queries, n_keys)`` bool: which keys each query attends (SPEC 10.1's mask)."""
    p = query_positions[:, None]
    j = key_positions[None, :]
    mask = j <= p
    if spec.window is not None:
        mask &= (p - j < spec.window - spec.keep) | (j < spec.keep)
    return mask


def weights(
    spec: QuerySpec,
    head: int,
    q: np.ndarray,
    k: np.ndarray,
    query_positions: np.ndarray,
    key_positions: np.ndarray,
) -> np.ndarray:
    """The softmax weights ``(n_queries, n_keys)`` float32 of queries ``q`` ``(n, dim)`` over
    keys ``k`` ``(m, dim)`` for query head ``head`` (SPEC 10.1)."""
    logits = (np.asarray(q, np.float32) @ np.asarray(k, np.float32).T) * np.float32(spec.scale)
    if spec.softcap is not None:
        cap = np.float32(spec.softcap)
        logits = cap * np.tanh(logits / cap)
    mask = visible(spec, query_positions, key_positions)
    logits = np.where(mask, logits, np.float32(-np.inf))
    top = logits.max(axis=1, initial=np.float32(-np.inf), keepdims=True)
    sink = None
    if spec.sinks is not None:
        sink = np.float32(spec.sinks[head])
        top = np.maximum(top, sink)
    top = np.where(np.isfinite(top), top, np.float32(0))  # a query that sees nothing: all zeros
    with np.errstate(under="ignore"):
        exp = np.exp(logits - top)
    exp[~mask] = 0.0
    total = exp.sum(axis=1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - top)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(total > 0, exp / np.where(total > 0, total, 1), 0)
    return out.astype(np.float32, copy=False)


def _inputs(
    snap: Snapshot, layer: int, head: int, seq: int, queries: tuple[int, int] | range | None
) -> tuple[QuerySpec, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The layer's queries description, the head's queries and positions, and its KV head's keys,
    values and positions (the snapshot's)."""
    spec = snap.layers[layer].queries
    found = snap.queries(layer, head, seq, positions=queries)
    if spec is None or found is None:
        raise ValueError(f"layer {layer} holds no queries")
    kv = snap.head(layer, spec.kv_heads[head], seq)
    assert kv is not None
    return spec, found.q, found.positions, kv.k, kv.v, kv.positions


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
    spec, q, q_positions, k, _v, k_positions = _inputs(snap, layer, head, seq, queries)
    columns = _within(keys, k_positions)
    for start in range(0, q.shape[0], block):
        rows = slice(start, start + block)
        found = weights(spec, head, q[rows], k, q_positions[rows], k_positions)
        yield Attention(layer, head, seq, found[:, columns], q_positions[rows], k_positions[columns])


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
    visible key; ``keys=(start, stop)`` returns only those columns)."""
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
    spec, q, q_positions, k, v, k_positions = _inputs(snap, layer, head, seq, queries)
    values = np.asarray(v, np.float32)
    out = np.empty((q.shape[0], values.shape[1]), np.float32)
    for start in range(0, q.shape[0], block):
        rows = slice(start, start + block)
        out[rows] = weights(spec, head, q[rows], k, q_positions[rows], k_positions) @ values
    return out, q_positions
