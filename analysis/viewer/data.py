"""What the viewer shows, computed from a file a block of queries at a time, never the whole map:
the head grid (the ``--stats attention`` scores, computed on first request and cached), one head's
attention map max-pooled to the screen (exact values when each tile is one cell), the weight each
key receives, one query's row (one head, or the mean over a layer's query heads), the keys a
compression method keeps, per-position K/V norms for files without queries, and the difference
of two files head by head."""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvformat
from kvformat import attention

from ..attention.compression import EVICTION, kept_mask
from ..attention.head_importance import attention_rows
from ..attention.tokens import token_pieces
from ..errors import AnalysisError
from ..tools.diff import head_diff

GRID_SCORES = ("sink_mass", "local_mass", "entropy_normalized", "retrieval_score", "streaming_error")
"""The scores a head grid can be coloured by (columns of ``--stats attention``)."""

MAX_TILES = 1024
"""The most tiles a map request may ask for along either axis."""

MAX_HEADS = 1 << 16
"""The most heads a layer may have (SPEC section 10): a head number past it names none."""


class ViewerError(AnalysisError):
    """A request the viewer cannot answer (one line, sent back as the answer's error)."""


@dataclass
class Source:
    """One file named on the command line: its path (or URL), opened lazily and shared by every
    request (reads are thread-safe), and its head-grid scores once computed."""

    path: str
    storage_options: dict[str, Any] | None = None
    _snap: kvformat.Snapshot | None = None
    _grid: list[dict[str, Any]] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def snap(self) -> kvformat.Snapshot:
        with self._lock:
            if self._snap is None:
                self._snap = kvformat.open(self.path, storage_options=self.storage_options)
            return self._snap

    def close(self) -> None:
        if self._snap is not None:
            self._snap.close()

    def info(self) -> dict[str, Any]:
        """Layers, heads, whether each layer holds queries, the tokens (text as data, never
        markup) and where the prompt ends."""
        snap = self.snap
        pieces = token_pieces(snap)
        meta = snap.metadata
        layers = [_layer_info(i, spec) for i, spec in enumerate(snap.layers)]
        prompt = meta.get("prompt_tokens")
        model = meta.get("model")
        return {
            "name": snap.name,
            "seq_len": snap.seq_len,
            "layers": layers,
            "has_queries": any(layer["query_heads"] for layer in layers),
            "tokens": pieces[0] if pieces else None,
            "prompt_end": int(meta.get("resumed_from_tokens", 0) or 0) + int(prompt) if prompt else None,
            "model": model.get("name") if isinstance(model, dict) else None,
        }

    def grid(self, score: str) -> dict[str, Any]:
        """``score`` per (layer, query head): ``{"score", "layers": [[value or None, ...], ...]}``."""
        if score not in GRID_SCORES:
            raise ViewerError(f"score must be one of {', '.join(GRID_SCORES)}, not {score!r}")
        with self._lock:
            if self._grid is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._grid = list(attention_rows(self.path, storage_options=self.storage_options))
            rows = self._grid
        by_layer: dict[int, dict[int, Any]] = {}
        for row in rows:
            value = row[score]
            by_layer.setdefault(row["layer"], {})[row["head"]] = (
                None if value is None or (isinstance(value, float) and math.isnan(value)) else value
            )
        layers = [
            [by_layer.get(layer, {}).get(head) for head in range(spec["query_heads"])]
            for layer, spec in enumerate(self.info()["layers"])
        ]
        return {"score": score, "layers": layers}


def _check_head(snap: kvformat.Snapshot, layer: int, head: int) -> kvformat.QuerySpec:
    if not 0 <= layer < snap.num_layers:
        raise ViewerError(f"layer {layer} out of range 0..{snap.num_layers - 1}")
    spec = snap.layers[layer].queries
    if spec is None:
        raise ViewerError(f"layer {layer} holds no queries: attention needs a capture with --queries")
    if not 0 <= head < spec.num_heads:
        raise ViewerError(f"query head {head} out of range 0..{spec.num_heads - 1}")
    return spec


def attention_map(
    snap: kvformat.Snapshot,
    layer: int,
    head: int,
    *,
    queries: tuple[int, int] | None = None,
    keys: tuple[int, int] | None = None,
    rows: int = 256,
    columns: int = 512,
) -> dict[str, Any]:
    """One head's map over query positions ``queries`` and key positions ``keys`` (``[start,
    stop)``, default everything), max-pooled into at most ``rows`` x ``columns`` tiles of whole
    positions: each tile holds the largest weight of its cells (masked and absent cells: -1), so
    a sink column or a single strong weight shows at any size; a tile of one cell holds its exact
    weight. ``received``: per key tile, the largest mean weight a key of it receives from the
    selected queries. Computed a block of queries at a time."""
    _check_head(snap, layer, head)
    rows, columns = min(max(rows, 1), MAX_TILES), min(max(columns, 1), MAX_TILES)
    held = snap.queries(layer, head)
    assert held is not None
    q_positions = held.positions
    if queries is not None:
        q_positions = q_positions[(q_positions >= queries[0]) & (q_positions < queries[1])]
    if not q_positions.size:
        raise ViewerError("no stored query in that range")
    q_low, q_high = int(q_positions[0]), int(q_positions[-1]) + 1
    k_low, k_high = keys if keys is not None else (0, q_high)
    k_low = min(max(k_low, 0), q_high - 1)  # inside the keys these queries see: bounded work
    k_high = max(min(k_high, q_high), k_low + 1)
    q_step = max(1, math.ceil((q_high - q_low) / rows))
    k_step = max(1, math.ceil((k_high - k_low) / columns))
    q_tiles = math.ceil((q_high - q_low) / q_step)
    k_tiles = math.ceil((k_high - k_low) / k_step)
    tiles = np.full((q_tiles, k_tiles), -1.0, np.float32)
    received = np.zeros(k_high - k_low, np.float64)
    counted = 0
    for block in _blocks(snap, layer, head, (q_low, q_high)):
        weights, at, key_positions = block
        inside = (key_positions >= k_low) & (key_positions < k_high)
        if at.size == 0:
            continue
        part = weights[:, inside]
        columns_at = key_positions[inside] - k_low
        received[columns_at] += part.sum(axis=0, dtype=np.float64)
        counted += at.size
        seen = attention.visible(snap.layers[layer].queries, at, key_positions[inside])  # type: ignore[arg-type]
        shown = np.where(seen, part, np.float32(-1))
        row_tiles = (at - q_low) // q_step
        col_tiles = columns_at // k_step
        # the largest value of each (row tile, column tile) of this block
        flat = row_tiles[:, None] * k_tiles + col_tiles[None, :]
        np.maximum.at(tiles.reshape(-1), flat.reshape(-1), shown.reshape(-1))
    refused = int(q_positions.size - counted)
    mean = received / max(counted, 1)
    padded = np.zeros(k_tiles * k_step)
    padded[: mean.size] = mean
    return {
        "layer": layer,
        "head": head,
        "queries": [q_low, q_high],
        "keys": [k_low, k_high],
        "step": [q_step, k_step],
        "tiles": tiles.round(7).tolist(),
        "received": padded.reshape(k_tiles, k_step).max(axis=1).round(7).tolist(),
        "exact": q_step == 1 and k_step == 1,
        "refused": refused,
    }


def _blocks(snap: kvformat.Snapshot, layer: int, head: int, span: tuple[int, int]) -> Any:
    """``(weights, query positions, key positions)`` a block of queries at a time over ``span``;
    queries whose keys the file no longer holds are left out (counted by the caller)."""
    spec = snap.layers[layer].queries
    assert spec is not None
    found = snap.queries(layer, head, positions=span)
    assert found is not None
    keys = attention.context_keys(snap, layer, spec.kv_heads[head], 0, found.positions)
    q = np.asarray(found.q, np.float32)[keys.complete]
    at = found.positions[keys.complete]
    k = np.asarray(keys.k, np.float32)
    for start in range(0, at.size, attention.BLOCK):
        rows = slice(start, start + attention.BLOCK)
        yield attention.weights(spec, head, q[rows], k, at[rows], keys.positions), at[rows], keys.positions


def query_row(snap: kvformat.Snapshot, layer: int, head: int, position: int) -> dict[str, Any]:
    """The weights one query gives every key: of query head ``head``, or with ``head`` -1 the mean
    over the layer's query heads. ``{"query", "keys": [...positions], "weights": [...]}``."""
    spec = _check_head(snap, layer, max(head, 0))
    heads = range(spec.num_heads) if head < 0 else [head]
    total: np.ndarray | None = None
    key_positions = None
    for h in heads:
        found = list(_blocks(snap, layer, h, (position, position + 1)))
        if not found or not found[0][1].size:
            raise ViewerError(f"no query at position {position} whose keys the file holds")
        weights, _, key_positions = found[0]
        total = weights[0].astype(np.float64) if total is None else total + weights[0]
    assert total is not None and key_positions is not None
    return {
        "layer": layer,
        "head": head,
        "query": position,
        "keys": key_positions.tolist(),
        "weights": (total / len(heads)).astype(np.float32).tolist(),
    }


def kept(snap: kvformat.Snapshot, layer: int, head: int, method: str, budget: float) -> dict[str, Any]:
    """The keys an eviction ``method`` keeps at ``budget``, as ``kvsnap simulate`` chooses them."""

    if method not in EVICTION:
        raise ViewerError(f"method must be one of {', '.join(EVICTION)}, not {method!r}")
    _check_head(snap, layer, head)
    try:
        positions, keep = kept_mask(snap, layer, head, method, budget)
    except ValueError as exc:
        raise ViewerError(str(exc)) from None
    return {"method": method, "budget": budget, "keys": positions.tolist(), "kept": keep.tolist()}


def kv_view(snap: kvformat.Snapshot, layer: int, head: int) -> dict[str, Any]:
    """Per position of one KV head: ``||k||``, ``||v||``, and the channel whose ``|k|`` is largest
    on average (the head's outlier channel) with its value per position."""
    if not 0 <= layer < snap.num_layers or not snap.layers[layer].present:
        raise ViewerError(f"layer {layer} is not a present layer of the file")
    if not 0 <= head < snap.layers[layer].num_heads:
        raise ViewerError(f"KV head {head} out of range 0..{snap.layers[layer].num_heads - 1}")
    data = snap.head(layer, head)
    assert data is not None
    k = np.asarray(data.k, np.float32)
    v = np.asarray(data.v, np.float32)
    with np.errstate(all="ignore"):
        channel = int(np.nanargmax(np.nanmean(np.abs(k), axis=0))) if k.size else 0
        return {
            "layer": layer,
            "head": head,
            "positions": data.positions.tolist(),
            "k_norm": _finite(np.linalg.norm(k, axis=1)),
            "v_norm": _finite(np.linalg.norm(v, axis=1)),
            "channel": channel,
            "k_channel": _finite(k[:, channel]) if k.size else [],
        }


def difference(a: kvformat.Snapshot, b: kvformat.Snapshot) -> dict[str, Any]:
    """Per (layer, KV head): ``||B - A|| / ||A||`` over the positions both hold, ``kvsnap diff``'s
    pairing (absolute positions; layouts must agree)."""

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table = head_diff(a.name, b.name)
    except ValueError as exc:
        raise ViewerError(str(exc)) from None
    out: dict[int, dict[int, Any]] = {}
    for row in table.filter(table["tensor"] == "k").iter_rows(named=True):
        value = row["rel_error"]
        out.setdefault(row["layer"], {})[row["head"]] = None if value is None or math.isnan(value) else value
    return {"layers": [[out[layer].get(h) for h in sorted(out[layer])] for layer in sorted(out)]}


def _finite(values: np.ndarray) -> list[float | None]:
    return [None if not math.isfinite(x) else round(float(x), 6) for x in values.tolist()]


__all__ = ["GRID_SCORES", "Source", "ViewerError", "attention_map", "kept", "kv_view", "query_row"]


def _layer_info(index: int, spec: Any) -> dict[str, Any]:
    """One layer as the page lists it: present, its KV and query heads, its window."""
    queries = spec.queries if spec.present else None
    return {
        "layer": index,
        "present": spec.present,
        "kv_heads": spec.num_heads if spec.present else 0,
        "query_heads": queries.num_heads if queries is not None else 0,
        "window": queries.window if queries is not None else None,
    }
