"""Per-head token-norm statistics, streamed chunk by chunk (bounded memory, one pass).

For each (sequence, layer, head, tensor) with per-token L2 norms ``r_t = ||x_t||``:
``norm_mean = mean(r)``, ``norm_std = sqrt(mean(r^2) - mean(r)^2)``, ``norm_min``, ``norm_max``,
and ``norm_sq_mean = mean(r^2)`` (what a "mean L2" that sums squares without a root reports).
Sums are float64; only one chunk of one head is in memory at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

import kvformat

if TYPE_CHECKING:
    import polars as pl

COLUMNS = (
    "file",
    "snapshot",
    "seq",
    "layer",
    "head",
    "tensor",
    "n_tokens",
    "norm_mean",
    "norm_std",
    "norm_min",
    "norm_max",
    "norm_sq_mean",
)
_PIECE = 1 << 14  # rows converted to float32 at a time


@dataclass
class NormAccumulator:
    """Mergeable moments of per-token norms: count, sum, sum of squares, min, max."""

    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    low: float = float("inf")
    high: float = float("-inf")

    def add(self, rows: np.ndarray) -> None:
        """Add ``rows``: ``(n_tokens, dim)`` of any float dtype."""
        for start in range(0, rows.shape[0], _PIECE):
            piece = np.asarray(rows[start : start + _PIECE], dtype=np.float32)
            sq = np.einsum("ij,ij->i", piece, piece, dtype=np.float64)
            norms = np.sqrt(sq)
            if norms.size:
                self.count += norms.size
                self.total += float(norms.sum())
                self.total_sq += float(sq.sum())
                self.low = min(self.low, float(norms.min()))
                self.high = max(self.high, float(norms.max()))

    def merge(self, other: NormAccumulator) -> None:
        self.count += other.count
        self.total += other.total
        self.total_sq += other.total_sq
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)

    def row(self) -> tuple[int, float, float, float, float, float]:
        if not self.count:
            nan = float("nan")
            return 0, nan, nan, nan, nan, nan
        mean = self.total / self.count
        sq_mean = self.total_sq / self.count
        return self.count, mean, float(np.sqrt(max(sq_mean - mean * mean, 0.0))), self.low, self.high, sq_mean


def norm_rows(path: str | os.PathLike[str], snapshot: int = -1) -> list[tuple[object, ...]]:
    """One row (see `COLUMNS`) per (seq, layer, head, tensor) of one file, in one pass."""
    accumulators: dict[tuple[int, int, int, str], NormAccumulator] = {}
    with kvformat.open(path, snapshot) as snap:
        for layer, spec in enumerate(snap.layers):
            for seq in range(snap.num_seqs):
                for head in range(spec.num_heads if spec.present else 0):
                    for tensor in ("k", "v"):
                        accumulators[(seq, layer, head, tensor)] = NormAccumulator()
        for block in snap.blocks():
            accumulators[(block.seq, block.layer, block.head, "k")].add(block.k)
            accumulators[(block.seq, block.layer, block.head, "v")].add(block.v)
        index = snap.index
    name = os.fspath(path)
    return [(name, index, *key, *acc.row()) for key, acc in sorted(accumulators.items())]


def head_norms(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], snapshot: int = -1
) -> pl.DataFrame:
    """A Polars DataFrame of `COLUMNS` for one file or many."""
    import polars as pl

    files = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    rows = [row for path in files for row in norm_rows(path, snapshot)]
    return pl.DataFrame(rows, schema=list(COLUMNS), orient="row")


def outliers(table: pl.DataFrame, factor: float = 1.5) -> pl.DataFrame:
    """Rows of K whose mean norm exceeds ``factor`` x the median over all heads of that file."""
    import polars as pl

    keys = table.filter(pl.col("tensor") == "k")
    return keys.with_columns(
        (pl.col("norm_mean") / pl.col("norm_mean").median().over("file")).alias("ratio_to_median")
    ).with_columns((pl.col("ratio_to_median") > factor).alias("outlier"))
