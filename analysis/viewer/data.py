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
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvformat
from kvformat import attention, pages

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
        snap = self.snap
        with self._lock:
            if self._grid is None:
                _held(snap).clear()  # the pass below needs the memory more
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    # on one thread: the other cores answer the page meanwhile, and the pass holds
                    # one KV head's buffers at a time
                    found = attention_rows(self.path, storage_options=self.storage_options, threads=1)
                    self._grid = list(found)
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


def _tiling(
    positions: np.ndarray, keys: tuple[int, int] | None, rows: int, columns: int
) -> tuple[tuple[int, int], tuple[int, int], int, int, tuple[int, int]]:
    """The query span, the key span, the tile steps and the tiles' shape of a map over query
    ``positions``."""
    rows, columns = min(max(rows, 1), MAX_TILES), min(max(columns, 1), MAX_TILES)
    q_low, q_high = int(positions[0]), int(positions[-1]) + 1
    k_low, k_high = keys if keys is not None else (0, q_high)
    k_low = min(max(k_low, 0), q_high - 1)  # inside the keys these queries see: bounded work
    k_high = max(min(k_high, q_high), k_low + 1)
    q_step = max(1, math.ceil((q_high - q_low) / rows))
    k_step = max(1, math.ceil((k_high - k_low) / columns))
    shape = (math.ceil((q_high - q_low) / q_step), math.ceil((k_high - k_low) / k_step))
    return (q_low, q_high), (k_low, k_high), q_step, k_step, shape


def _pool(
    out: np.ndarray, values: np.ndarray, row_tiles: np.ndarray, col_tiles: np.ndarray, ufunc: Any
) -> None:
    """Fold ``values`` ``(n, m)`` into ``out[row_tiles[i], col_tiles[j]]`` with ``ufunc``
    (``np.maximum`` or ``np.minimum``). Tile numbers that never decrease (positions in order, as
    a file holds them) fold whole runs at once (``reduceat``); others cell by cell."""
    if values.size == 0:
        return
    if np.all(np.diff(row_tiles) >= 0) and np.all(np.diff(col_tiles) >= 0):
        row_starts = np.flatnonzero(np.r_[True, row_tiles[1:] != row_tiles[:-1]])
        col_starts = np.flatnonzero(np.r_[True, col_tiles[1:] != col_tiles[:-1]])
        pooled = ufunc.reduceat(ufunc.reduceat(values, col_starts, axis=1), row_starts, axis=0)
        cells = np.ix_(row_tiles[row_starts], col_tiles[col_starts])
        out[cells] = ufunc(out[cells], pooled)
        return
    flat = row_tiles[:, None] * out.shape[1] + col_tiles[None, :]
    ufunc.at(out.reshape(-1), flat.reshape(-1), values.reshape(-1))


def attention_map(
    snap: kvformat.Snapshot,
    layer: int,
    head: int,
    *,
    queries: tuple[int, int] | None = None,
    keys: tuple[int, int] | None = None,
    rows: int = 256,
    columns: int = 512,
    as_array: bool = False,
) -> dict[str, Any]:
    """One head's map over query positions ``queries`` and key positions ``keys`` (``[start,
    stop)``, default everything), max-pooled into at most ``rows`` x ``columns`` tiles of whole
    positions: each tile holds the largest weight of its cells (masked and absent cells: -1), so
    a sink column or a single strong weight shows at any size; a tile of one cell holds its exact
    weight. ``received``: per key tile, the largest mean weight a key of it receives from the
    selected queries. Computed a block of queries at a time. ``tiles``: lists of rows, or with
    ``as_array`` one float32 array ``(row tiles, column tiles)``."""
    _check_head(snap, layer, head)
    held = snap.queries(layer, head)
    assert held is not None
    q_positions = _in_span(held.positions, queries)
    (q_low, q_high), (k_low, k_high), q_step, k_step, shape = _tiling(q_positions, keys, rows, columns)
    k_tiles = shape[1]
    tiles = np.full(shape, -1.0, np.float32)
    received = np.zeros(k_high - k_low, np.float64)
    counted = 0
    for weights, at, key_positions in _blocks(snap, layer, head, (q_low, q_high), (k_low, k_high)):
        columns_at = key_positions - k_low
        received[columns_at] += np.ones(at.size, np.float32) @ weights  # (masked weights are 0)
        counted += at.size
        chosen = attention.selected_rows(snap, layer, 0, at)
        _mark_unseen(snap.layers[layer].queries, weights, at, key_positions, chosen)  # type: ignore[arg-type]
        _pool(tiles, weights, (at - q_low) // q_step, columns_at // k_step, np.maximum)
    refused = int(q_positions.size - counted)
    mean = received / max(counted, 1)
    padded = np.zeros(k_tiles * k_step)
    padded[: mean.size] = mean
    return {
        **_placement(layer, head, (q_low, q_high, q_step), (k_low, k_high, k_step)),
        "tiles": tiles if as_array else tiles.round(7).tolist(),
        "received": padded.reshape(k_tiles, k_step).max(axis=1).round(7).tolist(),
        "exact": q_step == 1 and k_step == 1,
        "refused": refused,
    }


def attention_difference(
    a: kvformat.Snapshot,
    b: kvformat.Snapshot,
    layer: int,
    head: int,
    *,
    queries: tuple[int, int] | None = None,
    keys: tuple[int, int] | None = None,
    rows: int = 256,
    columns: int = 512,
    as_array: bool = False,
) -> dict[str, Any]:
    """File ``b``'s attention weights minus file ``a``'s, one head, over the query positions both
    hold, tiled as `attention_map` tiles (the same spans and steps for the same request). A key one
    file does not hold gets weight 0 there (it was not attended). Each tile holds the difference of
    largest magnitude among its cells, sign kept (None: every cell masked in both; NaN in the
    float32 array ``as_array`` gives); ``largest``: the largest magnitude over the whole request."""
    spec_a, spec_b = _check_head(a, layer, head), _check_head(b, layer, head)
    if spec_a.num_heads != spec_b.num_heads or spec_a.kv_heads[head] != spec_b.kv_heads[head]:
        raise ViewerError(f"layer {layer}: the two files' query heads are laid out differently")
    held_a, held_b = a.queries(layer, head), b.queries(layer, head)
    assert held_a is not None and held_b is not None
    common = _in_span(np.intersect1d(held_a.positions, held_b.positions), queries)
    (q_low, q_high), (k_low, k_high), q_step, k_step, shape = _tiling(common, keys, rows, columns)
    high, low, counted = _difference_extremes(
        (a, spec_a), (b, spec_b), layer, head, common, (q_low, q_high, q_step), (k_low, k_high, k_step), shape
    )
    if not counted:
        raise ViewerError("no query of that range has its keys in both files")
    tiles, listed = _signed_tiles(high, low, as_array)
    return {
        **_placement(layer, head, (q_low, q_high, q_step), (k_low, k_high, k_step)),
        "tiles": listed,
        "largest": float(np.abs(tiles).max()) if tiles.size else 0.0,
        "exact": q_step == 1 and k_step == 1,
        "compared": counted,
    }


def _placement(
    layer: int, head: int, query_tiling: tuple[int, int, int], key_tiling: tuple[int, int, int]
) -> dict[str, Any]:
    """Where a map's tiles lie: its head, its ``[low, high)`` query and key spans and their steps
    (the fields `attention_map` and `attention_difference` answer first)."""
    (q_low, q_high, q_step), (k_low, k_high, k_step) = query_tiling, key_tiling
    return {
        "layer": layer,
        "head": head,
        "queries": [q_low, q_high],
        "keys": [k_low, k_high],
        "step": [q_step, k_step],
    }


def _difference_extremes(
    first: tuple[kvformat.Snapshot, Any],
    second: tuple[kvformat.Snapshot, Any],
    layer: int,
    head: int,
    common: np.ndarray,
    query_tiling: tuple[int, int, int],
    key_tiling: tuple[int, int, int],
    shape: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray, int]:
    """For `attention_difference`: the largest and the smallest difference (second's weight minus
    first's) in each tile ``shape`` of the queries ``common`` (``(low, high, step)`` tilings of
    queries and keys), and the queries compared (those whose keys both files hold)."""
    (a, spec_a), (b, spec_b) = first, second
    q_low, q_high, q_step = query_tiling
    k_low, k_high, k_step = key_tiling
    high = np.full(shape, -np.inf, np.float32)
    low = np.full(shape, np.inf, np.float32)
    span, cut = (q_low, q_high), (k_low, k_high)
    _, q_a, at_a, k_a, keys_a = _head_inputs(a, layer, head, span, common)
    _, q_b, at_b, k_b, keys_b = _head_inputs(b, layer, head, span, common)
    both, in_a, in_b = np.intersect1d(at_a, at_b, assume_unique=True, return_indices=True)
    inside_a, inside_b = _inside(keys_a, cut), _inside(keys_b, cut)
    union = np.union1d(keys_a[inside_a], keys_b[inside_b])
    columns_a, columns_b = np.searchsorted(union, keys_a[inside_a]), np.searchsorted(union, keys_b[inside_b])
    col_tiles = (union - k_low) // k_step
    for start in range(0, both.size, attention.BLOCK):
        rows_at = slice(start, start + attention.BLOCK)
        at = both[rows_at]
        chosen_a, chosen_b = (
            attention.selected_rows(a, layer, 0, at),
            attention.selected_rows(b, layer, 0, at),
        )
        w_a = attention.weights(spec_a, head, q_a[in_a[rows_at]], k_a, at, keys_a, chosen_a)[:, inside_a]
        w_b = attention.weights(spec_b, head, q_b[in_b[rows_at]], k_b, at, keys_b, chosen_b)[:, inside_b]
        delta = np.zeros((at.size, union.size), np.float32)
        delta[:, columns_b] += w_b
        delta[:, columns_a] -= w_a
        seen = attention.visible(spec_a, at, union, chosen_a) | attention.visible(spec_b, at, union, chosen_b)
        row_tiles = (at - q_low) // q_step
        _pool(high, np.where(seen, delta, np.float32(-np.inf)), row_tiles, col_tiles, np.maximum)
        _pool(low, np.where(seen, delta, np.float32(np.inf)), row_tiles, col_tiles, np.minimum)
    return high, low, int(both.size)


def _signed_tiles(high: np.ndarray, low: np.ndarray, as_array: bool) -> tuple[np.ndarray, Any]:
    """Each tile's difference of largest magnitude, sign kept (0 where every cell is masked), and
    the same as sent: a float32 array with NaN, or lists with None, where every cell is masked."""
    signed = np.where(np.abs(low) > np.abs(high), low, high)
    shown = np.isfinite(signed)
    tiles = np.where(shown, signed, 0).round(7)
    if as_array:
        return tiles, np.where(shown, tiles, np.float32(np.nan)).astype(np.float32)
    listed = [
        [v if s else None for v, s in zip(r, m, strict=True)]
        for r, m in zip(tiles.tolist(), shown.tolist(), strict=True)
    ]
    return tiles, listed


MAX_POINTS = 32768
"""The most keys (and the most queries) a query-key projection draws; more are taken evenly."""


def qk_projection(
    snap: kvformat.Snapshot, layer: int, head: int, *, limit: int = MAX_POINTS
) -> dict[str, Any]:
    """One query head's stored queries and its KV head's keys in one 2-D plane, as AttentionViz
    draws them (Yeh et al. 2023, "AttentionViz: A Global View of Transformer Attention", section
    4.1): the keys translated so that their mean is the queries' mean (each query's logits all
    move by the same amount, so its softmax is unchanged), then queries scaled by ``s`` and keys
    by ``1/s`` so that their mean norms agree (dot products unchanged), then both projected on the
    two principal axes of the joint set (PCA of every query and key, in float32 with a float64
    covariance; each axis's sign fixed by its largest loading; ``explained``: the share of the
    variance each axis holds). Over ``limit`` keys or queries, every n-th is drawn (``step``)
    and the four first keys (attention sinks) always are. Coordinates in the projected units."""
    spec = _check_head(snap, layer, head)
    q_all, q_positions, _, k_all, k_positions = _head_context(snap, layer, head)
    if not q_all.size or not k_all.size:
        raise ViewerError(f"layer {layer} head {head}: no query or no key to draw")
    with np.errstate(all="ignore"):
        q_mean = q_all.mean(axis=0, dtype=np.float64)
        k = k_all - (k_all.mean(axis=0, dtype=np.float64) - q_mean).astype(np.float32)  # a new array
        q_norm = float(np.sqrt(np.einsum("ij,ij->i", q_all, q_all)).mean(dtype=np.float64))
        k_norm = float(np.sqrt(np.einsum("ij,ij->i", k, k)).mean(dtype=np.float64))
    if not (math.isfinite(q_norm) and math.isfinite(k_norm)) or q_norm <= 0 or k_norm <= 0:
        raise ViewerError(f"layer {layer} head {head}: its queries or keys are not finite, or all zero")
    scale = math.sqrt(k_norm / q_norm)
    q = q_all * np.float32(scale)
    k /= np.float32(scale)
    centre = (q.sum(axis=0, dtype=np.float64) + k.sum(axis=0, dtype=np.float64)) / (q.shape[0] + k.shape[0])
    q -= centre.astype(np.float32)
    k -= centre.astype(np.float32)
    gram = (q.T @ q).astype(np.float64) + (k.T @ k).astype(np.float64)
    values, vectors = np.linalg.eigh(gram)
    axes = vectors[:, ::-1][:, :2]
    axes = axes * np.where(axes[np.abs(axes).argmax(axis=0), [0, 1]] < 0, -1.0, 1.0)  # a sign of its own
    total = float(values.sum())
    explained = [float(v) / total if total > 0 else 0.0 for v in values[::-1][:2]]
    q_pick, q_step = _every(q_positions.size, limit, 0)
    k_pick, k_step = _every(k_positions.size, limit, 4)
    project = axes.astype(np.float32)
    return {
        "layer": layer,
        "head": head,
        "kv_head": spec.kv_heads[head],
        "queries": _points(q_positions[q_pick], q[q_pick] @ project),
        "keys": _points(k_positions[k_pick], k[k_pick] @ project),
        "step": [q_step, k_step],
        "explained": [round(x, 6) for x in explained],
        "scale": scale,
    }


def _every(count: int, limit: int, first: int) -> tuple[np.ndarray, int]:
    """Indices of every n-th of ``count`` (all when ``count <= limit``), the ``first`` always."""
    step = max(1, math.ceil(count / limit))
    picked = np.arange(0, count, step)
    if step > 1 and first:
        picked = np.union1d(np.arange(min(first, count)), picked)
    return picked, step


def _points(positions: np.ndarray, xy: np.ndarray) -> dict[str, list[Any]]:
    return {
        "positions": positions.tolist(),
        "x": xy[:, 0].astype(np.float32).round(5).tolist(),
        "y": xy[:, 1].astype(np.float32).round(5).tolist(),
    }


def _mark_unseen(
    spec: kvformat.QuerySpec,
    weights: np.ndarray,
    at: np.ndarray,
    key_positions: np.ndarray,
    chosen: np.ndarray | None = None,
) -> None:
    """Set ``weights`` ``(n, m)`` to -1 where query ``at[i]`` does not see key ``key_positions[j]``
    (SPEC 10.1's mask; ``chosen``: the queries' key selections in a sparse layer). Causal
    attention over keys in position order hides a run at the end of each row, set row by row;
    anything else goes through the whole mask."""
    ordered = key_positions.size < 2 or bool(np.all(key_positions[1:] > key_positions[:-1]))
    if spec.window is None and spec.chunk is None and chosen is None and ordered:
        for i, end in enumerate(np.searchsorted(key_positions, at, side="right").tolist()):
            weights[i, end:] = -1
        return
    np.putmask(weights, ~attention.visible(spec, at, key_positions, chosen), np.float32(-1))


def _in_span(positions: np.ndarray, span: tuple[int, int] | None) -> np.ndarray:
    """The query ``positions`` inside ``span``; `ViewerError` when none is."""
    if span is not None:
        positions = positions[(positions >= span[0]) & (positions < span[1])]
    if not positions.size:
        raise ViewerError("no stored query in that range")
    return positions


CACHE_BYTES = 128 << 20
"""The most bytes of float32 queries and keys the viewer keeps per open file: a head's map, its
query's row, the mean over its layer and its K/V view read the file once."""


@dataclass
class _Held:
    """The float32 arrays of the heads read last in one file, least recently used first out. A
    request for arrays another request is reading waits for that read instead of repeating it."""

    entries: OrderedDict[tuple[Any, ...], tuple[np.ndarray, ...]] = field(default_factory=OrderedDict)
    reading: dict[tuple[Any, ...], threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def find(self, prefix: tuple[Any, ...]) -> tuple[np.ndarray, ...] | None:
        """The entry whose key begins with ``prefix``, held or being read (then waited for)."""
        with self.lock:
            keys = [key for key in (*self.entries, *self.reading) if key[: len(prefix)] == prefix]
        return self.get(keys[0], None) if keys else None

    def get(self, key: tuple[Any, ...], read: Any) -> tuple[np.ndarray, ...] | Any:
        """The entry ``key``, read by ``read()`` if no request holds or is reading it (``read``
        None: None then)."""
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
            pending = self.reading.get(key)
            if pending is None and read is not None:
                self.reading[key] = threading.Event()
        if pending is not None:
            pending.wait()
            with self.lock:
                if key in self.entries:
                    return self.entries[key]
        if read is None:
            return None
        if pending is not None:  # that read failed or its entry left already: read it here
            return read()
        try:
            value = read()  # outside the lock: other requests go on meanwhile
            with self.lock:
                self.entries[key] = value
                while self.entries and self._bytes() > CACHE_BYTES:
                    self.entries.popitem(last=False)
            return value
        finally:
            with self.lock:
                self.reading.pop(key).set()

    def _bytes(self) -> int:
        return sum(a.nbytes for value in self.entries.values() for a in value)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


_HELD: weakref.WeakKeyDictionary[Any, _Held] = weakref.WeakKeyDictionary()
_HELD_LOCK = threading.Lock()


def _held(snap: kvformat.Snapshot) -> _Held:
    with _HELD_LOCK:
        if snap not in _HELD:
            _HELD[snap] = _Held()
        return _HELD[snap]


def _head_context(snap: kvformat.Snapshot, layer: int, head: int) -> tuple[np.ndarray, ...]:
    """Every stored query of ``head`` as float32 ``(n, dim)``, their positions, whether each one's
    keys are all in the file, and the keys ``(m, dim)`` float32 and key positions they saw (SPEC
    10.1's context keys of all of them: a query's mask picks its own), from the cache."""
    spec = snap.layers[layer].queries
    assert spec is not None
    kv_head = spec.kv_heads[head]

    def read_queries() -> tuple[np.ndarray, ...]:
        found = snap.queries(layer, head)
        assert found is not None
        return np.array(found.q, np.float32), np.asarray(found.positions)

    q, at = _held(snap).get(("q", layer, head), read_queries)

    def read_keys() -> tuple[np.ndarray, ...]:
        context = attention.context_keys(snap, layer, kv_head, 0, at, values=False)
        k = np.array(context.k, np.float32)  # a copy of its own: the file's pages can go
        _release(snap, layer, kv_head)
        return k, context.positions, context.complete

    k, positions, complete = _held(snap).get(("k", layer, kv_head, at.size, hash(at.tobytes())), read_keys)
    return q, at, complete, k, positions


def _release(snap: kvformat.Snapshot, layer: int, kv_head: int) -> None:
    """Let the pages of one KV head of the file leave the process once read (its resident set
    stays bounded however many heads a session visits; a later read faults them back in)."""
    pages.of(snap).release(snap._segments.of_head(layer, 0, kv_head))


def _head_inputs(
    snap: kvformat.Snapshot, layer: int, head: int, span: tuple[int, int], only: np.ndarray | None = None
) -> tuple[kvformat.QuerySpec, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The layer's queries description, then the head's queries ``(n, dim)`` float32 and their
    positions over ``span`` (of those, the positions ``only`` when given), and the keys
    ``(m, dim)`` float32 and key positions they saw; queries whose keys the file no longer holds
    are left out (counted by the caller)."""
    spec = snap.layers[layer].queries
    assert spec is not None
    q, at, complete, k, positions = _head_context(snap, layer, head)
    pick = complete & (at >= span[0]) & (at < span[1])
    if only is not None:
        pick &= np.isin(at, only)
    return spec, q[pick], at[pick], k, positions


def _blocks(
    snap: kvformat.Snapshot, layer: int, head: int, span: tuple[int, int], keys: tuple[int, int] | None = None
) -> Any:
    """``(weights, query positions, key positions)`` a block of queries at a time over ``span``,
    weights over the keys inside ``keys`` when given (each query's softmax is over every key it
    saw; only the columns are cut); queries whose keys the file no longer holds are left out."""
    spec, q, at, k, positions = _head_inputs(snap, layer, head, span)
    inside = _inside(positions, keys)
    chosen = attention.selected_rows(snap, layer, 0, at)
    for start in range(0, at.size, attention.BLOCK):
        rows = slice(start, start + attention.BLOCK)
        picked = chosen[rows] if chosen is not None else None
        block = attention.weights(spec, head, q[rows], k, at[rows], positions, picked)
        yield block[:, inside], at[rows], positions[inside]


def _inside(positions: np.ndarray, keys: tuple[int, int] | None) -> slice:
    """The run of (increasing) key ``positions`` inside ``keys`` ``[start, stop)``."""
    if keys is None:
        return slice(None)
    first, last = np.searchsorted(positions, keys, side="left").tolist()
    return slice(first, last)


MAX_ROW_KEYS = 4096
"""The most keys a query's row holds: past it, the half nearest the query and the heaviest half of
the others (so a needle far back shows), flagged ``complete: false``."""


def query_row(snap: kvformat.Snapshot, layer: int, head: int, position: int) -> dict[str, Any]:
    """The weights one query gives the keys it saw: of query head ``head``, or with ``head`` -1
    the mean over the layer's query heads. ``{"query", "keys": [...positions], "weights": [...],
    "seen": keys it saw, "complete": all of them listed}``; over `MAX_ROW_KEYS` keys, the nearest
    and the heaviest (see there)."""
    spec = _check_head(snap, layer, max(head, 0))
    heads = range(spec.num_heads) if head < 0 else [head]
    total: np.ndarray | None = None
    key_positions = np.empty(0, np.int64)
    chosen = attention.selected_rows(snap, layer, 0, np.array([position]))  # one row, every head's
    for h in heads:
        _, q, at, k, key_positions = _head_inputs(snap, layer, h, (position, position + 1))
        if not at.size:
            raise ViewerError(f"no query at position {position} whose keys the file holds")
        weights = attention.weights(spec, h, q, k, at, key_positions, chosen)[0]
        total = weights.astype(np.float64) if total is None else total + weights
    assert total is not None
    seen = np.flatnonzero(attention.visible(spec, np.array([position]), key_positions, chosen)[0])
    mean = (total / len(heads)).astype(np.float32)[seen]
    shown = np.arange(seen.size)
    if seen.size > MAX_ROW_KEYS:
        half = MAX_ROW_KEYS // 2
        older = np.argpartition(mean[:-half], -half)[-half:]
        shown = np.union1d(older, np.arange(seen.size - half, seen.size))
    return {
        "layer": layer,
        "head": head,
        "query": position,
        "keys": key_positions[seen[shown]].tolist(),
        "weights": mean[shown].tolist(),
        "seen": int(seen.size),
        "complete": bool(shown.size == seen.size),
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


MAX_KV_POINTS = 2048
"""The most points of a K/V view: past it, each point the largest of a run of positions."""


def kv_view(snap: kvformat.Snapshot, layer: int, head: int) -> dict[str, Any]:
    """Per position of one KV head: ``||k||``, ``||v||``, and the channel whose ``|k|`` is largest
    on average (the head's outlier channel) with its value per position. Over `MAX_KV_POINTS`
    positions, each point is the largest value over ``step`` consecutive stored positions (the
    signed channel value of largest magnitude), at the run's first position."""
    if not 0 <= layer < snap.num_layers or not snap.layers[layer].present:
        raise ViewerError(f"layer {layer} is not a present layer of the file")
    if not 0 <= head < snap.layers[layer].num_heads:
        raise ViewerError(f"KV head {head} out of range 0..{snap.layers[layer].num_heads - 1}")
    data = snap.head(layer, head)
    assert data is not None
    count = data.positions.size
    step = max(1, math.ceil(count / MAX_KV_POINTS))
    starts = np.arange(0, count, step)
    k_norm, v_norm = np.empty(count, np.float32), np.empty(count, np.float32)
    magnitude, finite = np.zeros(data.k.shape[1]), np.zeros(data.k.shape[1])
    with np.errstate(all="ignore"):
        for low in range(0, count, ROWS):  # a run of rows at a time: bounded memory
            v = np.asarray(data.v[low : low + ROWS], np.float32)
            v_norm[low : low + ROWS] = np.sqrt(np.einsum("ij,ij->i", v, v))
        held = _float32_keys(snap, layer, head, data)  # (perhaps a map's read, waited for)
        for low in range(0, count, ROWS):
            rows = slice(low, low + ROWS)
            k = np.asarray(held[rows], np.float32)
            k_norm[rows] = np.sqrt(np.einsum("ij,ij->i", k, k))
            size = np.abs(k)
            seen = np.isfinite(size)
            magnitude += np.where(seen, size, 0).sum(axis=0)
            finite += seen.sum(axis=0)
        mean = np.where(finite > 0, magnitude / np.maximum(finite, 1), -1)
    channel = int(np.argmax(mean)) if mean.size else 0
    values = np.asarray(held[:, channel], np.float32)
    _release(snap, layer, head)
    return {
        "layer": layer,
        "head": head,
        "positions": data.positions[starts].tolist(),
        "step": step,
        "k_norm": _finite(_largest(k_norm, starts)),
        "v_norm": _finite(_largest(v_norm, starts)),
        "channel": channel,
        "k_channel": _finite(_largest_magnitude(values, starts)),
    }


ROWS = 8192
"""Rows converted to float32 at a time by passes that read a whole head."""


def _float32_keys(snap: kvformat.Snapshot, layer: int, head: int, data: kvformat.Head) -> np.ndarray:
    """``data.k`` as float32 where the viewer's maps read it (the keys of a query head reading
    this KV head: from the cache, or read once for both), if they are these very keys; else
    ``data.k`` as the file holds it."""
    spec = snap.layers[layer].queries
    readers = [h for h, kv_head in enumerate(spec.kv_heads) if kv_head == head] if spec is not None else []
    if readers:
        _, _, _, k, positions = _head_context(snap, layer, readers[0])
        if k.shape == data.k.shape and np.array_equal(positions, data.positions):
            return k
    return data.k


def _largest(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The largest of each run of ``values`` beginning at ``starts`` (NaN where a run holds one)."""
    if not values.size:
        return values
    return np.maximum.reduceat(values, starts)


def _largest_magnitude(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The value of largest magnitude of each run (sign kept)."""
    if not values.size:
        return values
    high, low = np.maximum.reduceat(values, starts), np.minimum.reduceat(values, starts)
    return np.where(np.abs(low) > np.abs(high), low, high)


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


__all__ = [
    "GRID_SCORES",
    "Source",
    "ViewerError",
    "attention_difference",
    "attention_map",
    "kept",
    "kv_view",
    "qk_projection",
    "query_row",
]


def _layer_info(index: int, spec: Any) -> dict[str, Any]:
    """One layer as the page lists it: present, its KV and query heads, its window."""
    queries = spec.queries if spec.present else None
    return {
        "layer": index,
        "present": spec.present,
        "kv_heads": spec.num_heads if spec.present else 0,
        "query_heads": queries.num_heads if queries is not None else 0,
        "window": queries.window if queries is not None else None,
        "kv_of": list(queries.kv_heads) if queries is not None else [],
    }
