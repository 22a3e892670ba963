"""Compare two captures head by head: how far B's K and V are from A's at the positions both hold.

`head_diff(a, b)` reads one head of each file at a time (memory: two heads, whatever the file
sizes) and matches rows by absolute position, so sliding windows and series snapshots compare
where they overlap. One row per (`layer`, `head`, `seq`, `tensor`):

- ``n_positions``: positions both files hold for that head;
- ``rel_error``: ``||B - A||_F / ||A||_F`` over those positions and channels;
- ``max_abs_error``: ``max |B - A|``;
- ``cosine_mean``: mean over positions of ``cos(A_t, B_t)`` (a zero row against a zero row
  counts 1, against a non-zero row 0);
- ``norm_ratio``: ``mean ||B_t|| / mean ||A_t||``;
- ``first_divergent_position``: the first position whose row error ``||B_t - A_t|| / ||A_t||``
  exceeds ``tolerance`` or whose row holds inf or NaN on one side only, or null;
- ``nonfinite_positions``: the positions where A's or B's row holds inf or NaN (left out of
  every other column);
- ``tokens_diverge_at``: the first position of the sequence whose recorded token ids differ
  between the files, or null (the same ids throughout, or a file that records none);
- ``positions_left_out``: positions both files hold that were not compared because the token
  ids diverge before or at them.

Only positions before the token ids diverge are compared by default: K and V at a position are
computed from every token up to it, so once the two token streams differ (two generations that
sampled differently), later positions hold different computations, not a numerical difference,
even where a later token happens to agree. ``all_positions=True`` (``--all-positions``) compares
every shared position anyway. A warning names the position and what was left out.

Files whose layouts differ (present layers, heads, dims, sequences) are refused with one line
naming the difference. Files whose RoPE pairs channels differently (``(2i, 2i+1)``
against ``(i, i + dims/2)``: a capture from a GGUF conversion that kept llama.cpp's q/k
permutation against one in the checkpoint's order) are compared with the interleaved file's K
reordered into the other's order (`rope.interleaved_to_half`), with a warning saying so.
Arithmetic in float64.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

import kvformat
from kvformat.errors import InvalidArgumentError, UnknownNameError

from ..attention.tokens import token_ids
from ..dependencies import pl
from ..errors import LayoutMismatchError
from ..stats.rope import Rope, interleaved_to_half


def _layout_difference(a: kvformat.Snapshot, b: kvformat.Snapshot) -> str | None:
    if a.num_layers != b.num_layers:
        return f"{a.num_layers} layers vs {b.num_layers}"
    if a.num_seqs != b.num_seqs:
        return f"{a.num_seqs} sequences vs {b.num_seqs}"
    for layer, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        if x.present != y.present:
            return f"layer {layer} is {'present' if x.present else 'absent'} in A, not in B"
        if x.present and (x.num_heads, x.k_dim, x.v_dim) != (y.num_heads, y.k_dim, y.v_dim):
            return (
                f"layer {layer}: {x.num_heads} heads, k_dim {x.k_dim}, v_dim {x.v_dim} in A vs "
                f"{y.num_heads} heads, k_dim {y.k_dim}, v_dim {y.v_dim} in B"
            )
    return None


def _pairing_difference(a: kvformat.Snapshot, b: kvformat.Snapshot) -> int | None:
    """0 or 1: the file (A or B) whose RoPE pairs channels ``(2i, 2i+1)`` where the other pairs
    them ``(i, i + dims/2)``; None when both record the same pairing (or either records none)."""
    pairings = []
    for snap in (a, b):
        rope = snap.metadata.get("rope")
        pairings.append(rope.get("pairing") if isinstance(rope, dict) else None)
    if None in pairings or pairings[0] == pairings[1]:
        return None
    return pairings.index("interleaved") if "interleaved" in pairings else None


def token_divergence(a: kvformat.Snapshot, b: kvformat.Snapshot) -> list[int | None]:
    """Per sequence, the first position whose recorded token ids differ between the snapshots,
    or None (the same ids over the positions both record, or a snapshot that records none)."""
    ta, tb = token_ids(a), token_ids(b)
    if ta is None or tb is None:
        return [None] * a.num_seqs
    found: list[int | None] = []
    for seq in range(a.num_seqs):
        x = np.asarray(ta[seq] if seq < len(ta) else [], np.int64)
        y = np.asarray(tb[seq] if seq < len(tb) else [], np.int64)
        n = min(x.size, y.size)
        differ = np.flatnonzero(x[:n] != y[:n])
        found.append(int(differ[0]) if differ.size else None)
    return found


def _token_warning(diverge: list[int | None], all_positions: bool) -> str | None:
    for seq, position in enumerate(diverge):
        if position is not None:
            what = (
                "every shared position is compared anyway (all_positions)"
                if all_positions
                else f"only positions before {position} are compared (--all-positions compares every one)"
            )
            return f"token ids differ from position {position} of sequence {seq} on: {what}"
    return None


def _metrics(a: np.ndarray, b: np.ndarray, positions: np.ndarray, tolerance: float) -> dict[str, Any]:
    """The diff columns of rows ``a`` and ``b`` ``(n, dim)`` (float64) at ``positions``."""
    bad_a, bad_b = ~np.isfinite(a).all(axis=1), ~np.isfinite(b).all(axis=1)
    bad = bad_a | bad_b
    one_sided = positions[bad_a != bad_b]
    keep = ~bad
    found = _finite_metrics(a[keep], b[keep], positions[keep], tolerance)
    if one_sided.size:
        first = found["first_divergent_position"]
        candidate = int(one_sided[0])
        found["first_divergent_position"] = candidate if first is None else min(first, candidate)
    found["nonfinite_positions"] = positions[bad].tolist()
    return found


def _finite_metrics(a: np.ndarray, b: np.ndarray, positions: np.ndarray, tolerance: float) -> dict[str, Any]:
    """`_metrics` of rows that are finite on both sides."""
    n = positions.size
    if not n:
        return {
            "n_positions": 0,
            "rel_error": None,
            "max_abs_error": None,
            "cosine_mean": None,
            "norm_ratio": None,
            "first_divergent_position": None,
        }
    delta = b - a
    norm_a = np.linalg.norm(a, axis=1)
    norm_b = np.linalg.norm(b, axis=1)
    row_error = np.linalg.norm(delta, axis=1)
    total_a = float(np.sqrt((norm_a**2).sum()))
    with np.errstate(divide="ignore", invalid="ignore"):
        cosine = np.where(
            (norm_a > 0) & (norm_b > 0),
            (a * b).sum(axis=1) / (norm_a * norm_b),
            np.where((norm_a == 0) & (norm_b == 0), 1.0, 0.0),
        )
        relative_rows = np.where(norm_a > 0, row_error / norm_a, np.where(row_error > 0, np.inf, 0.0))
    divergent = np.flatnonzero(relative_rows > tolerance)
    mean_a = float(norm_a.mean())
    return {
        "n_positions": int(n),
        "rel_error": float(np.sqrt((row_error**2).sum()) / total_a) if total_a > 0 else float("nan"),
        "max_abs_error": float(np.abs(delta).max()),
        "cosine_mean": float(cosine.mean()),
        "norm_ratio": float(norm_b.mean() / mean_a) if mean_a > 0 else float("nan"),
        "first_divergent_position": int(positions[divergent[0]]) if divergent.size else None,
    }


def _check_pair(
    first: kvformat.Snapshot,
    second: kvformat.Snapshot,
    a: str,
    b: str,
    diverge: list[int | None],
    every: bool,
) -> int | None:
    """`LayoutMismatchError` unless the two layouts match; warnings for differing token ids and
    RoPE channel pairings. Which file's K is reordered (0 or 1), or None."""
    difference = _layout_difference(first, second)
    if difference is not None:
        raise LayoutMismatchError(f"{a} and {b} differ: {difference}")
    message = _token_warning(diverge, every)
    if message is not None:
        warnings.warn(f"{a} vs {b}: {message}", UserWarning, stacklevel=3)
    reorder = _pairing_difference(first, second)
    if reorder is not None:
        which = a if reorder == 0 else b
        warnings.warn(
            f"{a} and {b} pair RoPE channels differently ((2i, 2i+1) in {which}, "
            f"(i, i + dims/2) in the other): {which}'s K is compared in the other's channel order",
            UserWarning,
            stacklevel=3,
        )
    return reorder


def _comparable_keys(
    p: np.ndarray, q: np.ndarray, shared: np.ndarray, ropes: list[Rope | None], keys: str, reorder: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """K rows ``(n, k_dim)`` of both files at positions ``shared``, un-rotated for
    ``keys="pre_rope"`` and in one channel order when the files pair RoPE channels differently."""
    if keys == "pre_rope" and ropes[0] and ropes[1]:
        p = ropes[0].rotate(p, shared, inverse=True).astype(np.float64)
        q = ropes[1].rotate(q, shared, inverse=True).astype(np.float64)
    if reorder is not None:
        rope = ropes[reorder]
        assert rope is not None
        if reorder == 0:
            p = interleaved_to_half(p, rope.dims)
        else:
            q = interleaved_to_half(q, rope.dims)
    return p, q


def _ropes(snaps: tuple[Any, Any], layer: int, needed: bool) -> list[Rope | None]:
    """Each file's RoPE of ``layer`` where keys must be un-rotated or reordered, else None."""
    return [
        Rope.from_metadata(snap.metadata, snap.layers[layer].attributes, snap.layers[layer].k_dim)
        if needed
        else None
        for snap in snaps
    ]


def _head_rows(
    where: dict[str, Any],
    x: Any,
    y: Any,
    ropes: list[Rope | None],
    keys: str,
    reorder: int | None,
    tolerance: float,
    stop: int | None,
) -> list[dict[str, Any]]:
    """The K and V rows of one head: ``y`` against ``x`` over the positions both hold, before
    ``stop`` (None: all of them)."""
    shared, in_x, in_y = np.intersect1d(x.positions, y.positions, return_indices=True)
    left_out = 0
    if stop is not None:
        keep = shared < stop
        left_out = int(shared.size - keep.sum())
        shared, in_x, in_y = shared[keep], in_x[keep], in_y[keep]
    rows = []
    for tensor, left, right in (("k", x.k, y.k), ("v", x.v, y.v)):
        p = np.asarray(left, dtype=np.float64)[in_x]
        q = np.asarray(right, dtype=np.float64)[in_y]
        if tensor == "k":
            p, q = _comparable_keys(p, q, shared, ropes, keys, reorder)
        found = _metrics(p, q, shared, tolerance)
        rows.append({**where, "tensor": tensor, **found, "positions_left_out": left_out})
    return rows


def head_diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    snapshot_a: int = -1,
    snapshot_b: int = -1,
    keys: str = "post_rope",
    tolerance: float = 1e-3,
    storage_options: dict[str, Any] | None = None,
    all_positions: bool = False,
) -> pl.DataFrame:
    """One row per (layer, head, seq, tensor) comparing file ``b`` to file ``a`` (see the module
    docstring for the columns) at the positions both hold before their token ids diverge (every
    shared position with ``all_positions``); ``keys="pre_rope"`` un-rotates both files' K first.
    `LayoutMismatchError` if the layouts differ; a `UserWarning` if the token ids differ."""

    if keys not in ("post_rope", "pre_rope"):
        raise UnknownNameError("keys must be 'post_rope' or 'pre_rope'")
    if not tolerance > 0:
        raise InvalidArgumentError(f"tolerance must be above 0, got {tolerance}")
    rows: list[dict[str, Any]] = []
    with (
        kvformat.open(a, snapshot_a, storage_options=storage_options) as first,
        kvformat.open(b, snapshot_b, storage_options=storage_options) as second,
    ):
        diverge = token_divergence(first, second)
        reorder = _check_pair(first, second, os.fspath(a), os.fspath(b), diverge, all_positions)
        for layer, spec in enumerate(first.layers):
            if not spec.present:
                continue
            ropes = _ropes((first, second), layer, keys == "pre_rope" or reorder is not None)
            for seq in range(first.num_seqs):
                for head in range(spec.num_heads):
                    x, y = first.head(layer, head, seq), second.head(layer, head, seq)
                    assert x is not None and y is not None
                    where = {"layer": layer, "head": head, "seq": seq}
                    stop = None if all_positions else diverge[seq]
                    found = _head_rows(where, x, y, ropes, keys, reorder, tolerance, stop)
                    rows.extend({**row, "tokens_diverge_at": diverge[seq]} for row in found)
    schema: dict[str, Any] = {
        "layer": pl.Int64,
        "head": pl.Int64,
        "seq": pl.Int64,
        "tensor": pl.String,
        "n_positions": pl.Int64,
        "rel_error": pl.Float64,
        "max_abs_error": pl.Float64,
        "cosine_mean": pl.Float64,
        "norm_ratio": pl.Float64,
        "first_divergent_position": pl.Int64,
        "nonfinite_positions": pl.List(pl.Int64),
        "positions_left_out": pl.Int64,
        "tokens_diverge_at": pl.Int64,
    }
    return pl.DataFrame(rows, schema=schema)
