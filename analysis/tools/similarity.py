"""Cross-head and cross-layer similarity of K and V (statistics 9 and 10 of the catalogue).

For two token-aligned sets ``X`` ``(n, d1)`` and ``Y`` ``(n, d2)`` (the same positions):

- linear CKA: ``C_xy = Xᵀ Y / n - μ_x μ_yᵀ`` (cross-covariance) and
  ``CKA = ||C_xy||²_F / (||C_xx||_F ||C_yy||_F)``, in [0, 1]; invariant to rotations and
  isotropic scaling of either side, so it compares what two heads encode, not their basis;
- mean token-wise cosine: ``mean_t <x_t, y_t> / (||x_t|| ||y_t||)`` (``d1 == d2`` only; a zero
  row counts as cosine 0).

Cross-head pairs are every pair of KV heads of one layer; cross-layer pairs are the same head
index in adjacent present layers, over the positions both hold (a sliding-window layer holds
fewer). Both stream position windows of one layer (or two) at a time, so memory is bounded by a
window and the ``(heads · head_dim)²`` float64 Gram matrix, never by the file.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import kvformat
from kvformat.errors import UnknownNameError

from ..dependencies import pa, pl
from ..engine import executors
from ..engine.parallel import cores
from ..stats.rope import Rope

WINDOW_BYTES = 64 << 20  # float64 bytes of one window of one layer's heads


class _Aligned:
    """Mergeable sums over token-aligned rows of several streams (each ``(n, d)``)."""

    def __init__(self, dims: list[int]) -> None:
        self.dims = dims
        self.edges = np.concatenate([[0], np.cumsum(dims)]).astype(int)
        width = int(self.edges[-1])
        self.gram = np.zeros((width, width))
        self.total = np.zeros(width)
        self.count = 0
        self.cosine = np.zeros((len(dims), len(dims)))

    def add(self, streams: list[np.ndarray]) -> None:
        rows = np.concatenate([np.asarray(s, dtype=np.float64) for s in streams], axis=1)
        self.gram += rows.T @ rows
        self.total += rows.sum(axis=0)
        self.count += rows.shape[0]
        units = []
        for s in streams:
            x = np.asarray(s, dtype=np.float64)
            norm = np.linalg.norm(x, axis=1, keepdims=True)
            units.append(np.divide(x, norm, out=np.zeros_like(x), where=norm > 0))
        for i in range(len(streams)):
            for j in range(i + 1, len(streams)):
                if units[i].shape[1] == units[j].shape[1]:
                    self.cosine[i, j] += float(np.einsum("nd,nd->", units[i], units[j]))

    def pair(self, i: int, j: int) -> tuple[float, float]:
        """``(cka, cosine_mean)`` of streams ``i`` and ``j`` (NaN when undefined)."""
        if self.count == 0:
            return float("nan"), float("nan")
        mean = self.total / self.count
        cov = self.gram / self.count - np.outer(mean, mean)
        a, b = slice(self.edges[i], self.edges[i + 1]), slice(self.edges[j], self.edges[j + 1])
        denominator = float(np.linalg.norm(cov[a, a]) * np.linalg.norm(cov[b, b]))
        cka = float(np.sum(cov[a, b] ** 2) / denominator) if denominator > 0 else float("nan")
        same = self.dims[i] == self.dims[j]
        return cka, (float(self.cosine[i, j] / self.count) if same else float("nan"))


def _windows(positions: np.ndarray, size: int) -> Iterator[tuple[int, int]]:
    for first in range(0, positions.size, size):
        last = min(positions.size, first + size) - 1
        yield int(positions[first]), int(positions[last]) + 1


def _rows_of(
    snap: kvformat.Snapshot, layer: int, head: int, seq: int, tensor: str, window: tuple[int, int], rope: Any
) -> tuple[np.ndarray, np.ndarray]:
    data = snap.head(layer, head, seq, positions=window)
    assert data is not None
    rows = data.k if tensor == "k" else data.v
    if tensor == "k" and rope is not None:
        rows = rope.rotate(rows, data.positions, inverse=True)
    return np.asarray(rows, dtype=np.float64), data.positions


def similarity_rows(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    keys: str = "post_rope",
    storage_options: dict[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows ``{file, snapshot, seq, tensor, kind ("head" | "layer"), layer, head, other_layer,
    other_head, n_tokens, cka, cosine_mean}`` for one file, streamed a layer at a time."""
    if keys not in ("post_rope", "pre_rope"):
        raise UnknownNameError("keys must be 'post_rope' or 'pre_rope'")
    with kvformat.open(path, snapshot, storage_options=storage_options) as snap:
        name, index = os.fspath(path), snap.index
        present = [i for i, spec in enumerate(snap.layers) if spec.present and spec.num_heads > 0]
        ropes = _ropes(snap, present) if keys == "pre_rope" else dict.fromkeys(present)
        for seq in range(snap.num_seqs):
            for tensor in ("k", "v"):
                for layer in present:
                    yield from _cross_head(snap, name, index, seq, tensor, layer, ropes[layer])
                for layer, other in itertools.pairwise(present):
                    yield from _cross_layer(snap, name, index, seq, tensor, layer, other, ropes)


def _ropes(snap: kvformat.Snapshot, layers: list[int]) -> dict[int, Rope | None]:
    """Each layer's recorded RoPE, to un-rotate K (``keys="pre_rope"``)."""
    return {
        layer: Rope.from_metadata(snap.metadata, snap.layers[layer].attributes, snap.layers[layer].k_dim)
        for layer in layers
    }


def _base(name: str, index: int, seq: int, tensor: str) -> dict[str, Any]:
    return {"file": name, "snapshot": index, "seq": seq, "tensor": tensor}


def _cross_head(
    snap: kvformat.Snapshot, name: str, index: int, seq: int, tensor: str, layer: int, rope: Any
) -> Iterator[dict[str, Any]]:
    spec = snap.layers[layer]
    dim = spec.k_dim if tensor == "k" else spec.v_dim
    heads = spec.num_heads
    positions = snap.positions(layer, 0, seq)
    acc = _Aligned([dim] * heads)
    if positions is not None and positions.size:
        size = max(1, WINDOW_BYTES // (8 * dim * heads))
        for window in _windows(positions, size):
            acc.add([_rows_of(snap, layer, h, seq, tensor, window, rope)[0] for h in range(heads)])
    for i in range(heads):
        for j in range(i + 1, heads):
            cka, cosine = acc.pair(i, j)
            yield {
                **_base(name, index, seq, tensor),
                "kind": "head",
                "layer": layer,
                "head": i,
                "other_layer": layer,
                "other_head": j,
                "n_tokens": acc.count,
                "cka": cka,
                "cosine_mean": cosine,
            }


def _cross_layer(
    snap: kvformat.Snapshot,
    name: str,
    index: int,
    seq: int,
    tensor: str,
    layer: int,
    other: int,
    ropes: dict[int, Any],
) -> Iterator[dict[str, Any]]:
    a, b = snap.layers[layer], snap.layers[other]
    for head in range(min(a.num_heads, b.num_heads)):
        dims = [a.k_dim, b.k_dim] if tensor == "k" else [a.v_dim, b.v_dim]
        acc = _Aligned(dims)
        first, second = snap.positions(layer, head, seq), snap.positions(other, head, seq)
        shared = np.intersect1d(first, second) if first is not None and second is not None else np.empty(0)
        size = max(1, WINDOW_BYTES // (8 * sum(dims)))
        for window in _windows(shared, size):
            x, px = _rows_of(snap, layer, head, seq, tensor, window, ropes[layer])
            y, py = _rows_of(snap, other, head, seq, tensor, window, ropes[other])
            keep = np.intersect1d(px, py)
            acc.add([x[np.isin(px, keep)], y[np.isin(py, keep)]])
        cka, cosine = acc.pair(0, 1)
        yield {
            **_base(name, index, seq, tensor),
            "kind": "layer",
            "layer": layer,
            "head": head,
            "other_layer": other,
            "other_head": head,
            "n_tokens": acc.count,
            "cka": cka,
            "cosine_mean": cosine,
        }


def similarity_for_file(
    path: str | os.PathLike[str],
    snapshot: int = -1,
    keys: str = "post_rope",
    storage_options: dict[str, Any] | None = None,
) -> Iterator[pa.Table]:
    """The similarity rows of one file as Arrow tables (one per sequence and tensor)."""

    batch: list[dict[str, Any]] = []
    for row in similarity_rows(path, snapshot, keys, storage_options):
        if batch and (row["seq"], row["tensor"]) != (batch[-1]["seq"], batch[-1]["tensor"]):
            yield pa.Table.from_pylist(batch)
            batch = []
        batch.append(row)
    if batch:
        yield pa.Table.from_pylist(batch)


def _file_tables(
    path: str | os.PathLike[str], snapshot: int, keys: str, storage_options: dict[str, Any] | None
) -> list[pa.Table]:
    return list(similarity_for_file(path, snapshot, keys, storage_options))


def head_similarity(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    snapshot: int = -1,
    keys: str = "post_rope",
    jobs: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> pl.DataFrame:
    """Cross-head and cross-layer similarity of one or more files (paths or URLs) as a Polars
    DataFrame, each row naming its ``file``; files run in up to ``jobs`` processes (default:
    every core)."""

    files = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    with executors.for_tasks(cores() if jobs is None else jobs, len(files)) as executor:
        tables = [
            pl.from_arrow(t)
            for per_file in executor.map(_file_tables, files, snapshot, keys, storage_options)
            for t in per_file
        ]
    frames = [t for t in tables if isinstance(t, pl.DataFrame)]
    return pl.concat(frames) if frames else pl.DataFrame()
