"""Per-head statistics of the recurrent state a file stores (SPEC 15.4): hybrid and state-space
models' convolution windows, SSM, gated-delta and RWKV states, snapshot by snapshot.

One row per (snapshot, layer, slot, head, sequence): the state matrix ``M`` is the array of one
sequence (and head), its first remaining axis as rows and the others flattened as columns
(a gated-delta state ``(Dv, Dk)``, a convolution window ``(kernel - 1, channels)``). Columns:

- ``norm`` (Frobenius), ``max_abs``, ``mean``, ``std`` of its finite values, and
  ``nonfinite_values`` (NaN and infinities counted, left out of everything else);
- ``singular_values``: the largest 8 singular values of ``M`` (from the eigenvalues of its
  smaller Gram matrix); ``effective_rank``:
  ``exp(entropy(p))`` with ``p_i = s_i^2 / sum(s^2)`` (the energy distribution, as the K/V
  spectrum's ``effective_rank`` of the covariance's eigenvalues); ``rank_90``: the fewest singular
  values holding 90% of the energy;
- ``change``: ``||M - M_prev||_F / ||M_prev||_F`` against the same array in the snapshot before
  (null in the first, or where that one held none).

Memory: one array at a time, copied from the memory-mapped file whose pages are then
released (a Qwen3-Next-sized head is 64 KiB), and the previous snapshot's copy of it: bounded by
the largest state array, not by the file or the number of snapshots.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

import kvformat
from kvformat import state as stored_state

from ..dependencies import pa, pl
from ..engine.files import FileFailure, describe_error, expand_paths
from ..errors import AnalysisError

TOP = 8
"""Singular values kept per row."""

COLUMNS = (
    ("file", "string"),
    ("snapshot", "int64"),
    ("generated", "int64"),
    ("layer", "int64"),
    ("slot", "int64"),
    ("role", "string"),
    ("head", "int64"),
    ("seq", "int64"),
    ("rows", "int64"),
    ("cols", "int64"),
    ("dtype", "string"),
    ("norm", "float64"),
    ("max_abs", "float64"),
    ("mean", "float64"),
    ("std", "float64"),
    ("nonfinite_values", "int64"),
    ("effective_rank", "float64"),
    ("rank_90", "int64"),
    ("singular_values", "list"),
    ("change", "float64"),
)


class NoStateError(AnalysisError):
    """A file that holds no recurrent state (SPEC 15.4): not a hybrid or state-space model's."""


def matrix_statistics(matrix: np.ndarray) -> dict[str, Any]:
    """The statistics of one state matrix ``(rows, cols)`` (float64 inside; non-finite values
    counted and set to 0 for the rest)."""
    values = matrix.astype(np.float64)
    finite = np.isfinite(values)
    bad = int(values.size - finite.sum())
    if bad:
        values = np.where(finite, values, 0.0)
    kept = values[finite] if bad else values.reshape(-1)
    # The energies s_i^2 are the eigenvalues of the smaller Gram matrix (3x faster than an SVD
    # of a 128 x 128 state, and exact in the energies the effective rank is made of).
    gram = values @ values.T if values.shape[0] <= values.shape[1] else values.T @ values
    energy = np.clip(np.linalg.eigvalsh(gram)[::-1], 0.0, None) if values.size else np.zeros(0)
    singular = np.sqrt(energy)
    total = float(energy.sum())
    if total > 0:
        p = energy / total
        nonzero = p[p > 0]
        effective = float(np.exp(-(nonzero * np.log(nonzero)).sum()))
        rank_90 = int((np.cumsum(p) < 0.9).sum() + 1)
    else:
        effective, rank_90 = 0.0, 0
    return {
        "norm": float(np.sqrt(total)),
        "max_abs": float(np.abs(kept).max()) if kept.size else float("nan"),
        "mean": float(kept.mean()) if kept.size else float("nan"),
        "std": float(kept.std()) if kept.size else float("nan"),
        "nonfinite_values": bad,
        "effective_rank": effective,
        "rank_90": rank_90,
        "singular_values": singular[:TOP].tolist(),
    }


def _matrices(array: np.ndarray) -> list[np.ndarray]:
    """Per sequence, the state matrix of ``array`` ``(S, a, b, ...)``: ``(a, b * ...)``
    (``(1, a)`` for ``(S, a)``, ``(1, 1)`` for ``(S,)``)."""
    per_seq = array.reshape(array.shape[0], -1) if array.ndim <= 2 else array
    return [
        np.atleast_2d(x.reshape(x.shape[0], math.prod(x.shape[1:])) if x.ndim >= 2 else x.reshape(1, -1))
        for x in per_seq
    ]


def state_rows(
    path: str | os.PathLike[str], snapshot: int | None = None, storage_options: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The rows (module docstring) of every snapshot of one file, or of snapshot ``snapshot``
    only (its ``change`` still against the snapshot before). `NoStateError` for a file without
    recurrent state."""
    rows: list[dict[str, Any]] = []
    name = os.fspath(path)
    with kvformat.open(path, storage_options=storage_options) as first:
        arrays = list(stored_state.state_arrays(first.layers))
        if not arrays:
            raise NoStateError(
                f"{name}: holds no recurrent state (not a hybrid or state-space model's capture)"
            )
        count = first.num_snapshots
        chosen = (
            range(count) if snapshot is None else [snapshot % count if -count <= snapshot < count else -1]
        )
        if chosen and min(chosen) < 0:
            raise kvformat.OutOfRangeError(f"{name}: snapshot {snapshot} out of range 0..{count - 1}")
        start = max(min(chosen) - 1, 0)
        views = {index: first.select(index) for index in range(start, max(chosen) + 1)}

        def one_array(array: stored_state.StateArray) -> list[dict[str, Any]]:
            """Every chosen snapshot's rows of one array (its snapshots in order, for ``change``)."""
            found: list[dict[str, Any]] = []
            previous: list[np.ndarray] | None = None
            for index, view in views.items():
                value = stored_state.read(view, array, release=True)
                matrices = _matrices(value) if value is not None else None
                if index in chosen and matrices is not None:
                    generated = view.snapshot_metadata.get("generated")
                    for seq, matrix in enumerate(matrices):
                        found.append(
                            {
                                "file": name,
                                "snapshot": index,
                                "generated": generated if isinstance(generated, int) else None,
                                "layer": array.layer,
                                "slot": array.slot,
                                "role": array.role,
                                "head": array.head,
                                "seq": seq,
                                "rows": int(matrix.shape[0]),
                                "cols": int(matrix.shape[1]),
                                "dtype": array.dtype or value.dtype.name,  # type: ignore[union-attr]
                                **matrix_statistics(matrix),
                                "change": _change(matrix, previous[seq] if previous else None),
                            }
                        )
                previous = [m.astype(np.float64) for m in matrices] if matrices is not None else None
            return found

        # One thread: the Gram products already run on BLAS's threads (a pool of one array per
        # core measured 1.5x slower on 2 cores, `python -m benchmarks.state_bench`).
        for array in arrays:
            rows += one_array(array)
    rows.sort(key=lambda row: row["snapshot"])  # stable: array order within a snapshot
    return rows


def _change(matrix: np.ndarray, before: np.ndarray | None) -> float | None:
    if before is None or before.shape != matrix.shape:
        return None
    scale = float(np.linalg.norm(before))
    difference = float(np.linalg.norm(matrix.astype(np.float64) - before))
    return difference / scale if scale > 0 else (0.0 if difference == 0 else float("inf"))


def state_table(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    snapshot: int | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    failures: list[FileFailure] | None = None,
) -> Any:
    """`state_rows` of one or more files or patterns as an Arrow table (``kvsnap stats --stats
    state``). A file that fails raises its error; given ``failures``, it is recorded there
    (`FileFailure`) and the other files go on."""
    patterns = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    rows: list[dict[str, Any]] = []
    for path in expand_paths([os.fspath(p) for p in patterns], storage_options):
        try:
            rows += state_rows(path, snapshot, storage_options)
        except (kvformat.KVSnapError, OSError) as exc:
            if failures is None:
                raise
            failures.append(FileFailure(path, describe_error(exc)))
    types = {
        "string": pa.string(),
        "int64": pa.int64(),
        "float64": pa.float64(),
        "list": pa.list_(pa.float64()),
    }
    schema = pa.schema([(column, types[kind]) for column, kind in COLUMNS])
    return pa.table({column: [row[column] for row in rows] for column, _ in COLUMNS}, schema=schema)


def state_stats(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    snapshot: int | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """`state_table` as a Polars DataFrame: per (file, snapshot, layer, slot, head, seq) the
    recurrent state's norms, spectrum, effective rank and change since the snapshot before."""
    return pl.from_arrow(state_table(paths, snapshot, storage_options=storage_options))
