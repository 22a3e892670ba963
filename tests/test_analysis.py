"""Streaming per-head norm statistics equal a direct whole-array computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

import kvformat
from analysis.stats import head_stats, outliers
from kvformat.cli import main


def test_norm_statistics_match_numpy(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    k = rng.standard_normal((3, 50, 16)).astype(np.float16)
    k[2] *= 4
    v = rng.standard_normal((3, 50, 8)).astype(np.float16)
    path = tmp_path / "n.kv"
    kvformat.save(path, [kvformat.Layer(k, v), None, kvformat.Layer(k[:, :7], v[:, :7])], chunk_bytes=160)
    table = head_stats(path)
    assert table.height == 2 * 3 * 2
    for head in range(3):
        norms = np.linalg.norm(k[head].astype(np.float64), axis=1)
        row = table.filter((pl.col("layer") == 0) & (pl.col("head") == head) & (pl.col("tensor") == "k")).row(
            0, named=True
        )
        assert row["n_tokens"] == 50
        np.testing.assert_allclose(row["norm_mean"], norms.mean(), rtol=1e-6)
        np.testing.assert_allclose(row["norm_std"], norms.std(), rtol=1e-5)
        np.testing.assert_allclose(row["norm_sq_mean"], (norms**2).mean(), rtol=1e-6)
        np.testing.assert_allclose([row["norm_min"], row["norm_max"]], [norms.min(), norms.max()], rtol=1e-6)
    flagged = outliers(table)
    assert flagged.filter(pl.col("outlier"))["head"].to_list() == [2, 2]


def test_stats_command(tmp_path: Path, capsys: object) -> None:
    k = np.ones((2, 4, 4), np.float32)
    k[1] *= 10
    kvformat.save(tmp_path / "s.kv", [kvformat.Layer(k, k)])
    assert main(["stats", str(tmp_path / "s.kv"), "-o", str(tmp_path / "s.parquet")]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "h1=  20.00*" in out
    assert pl.read_parquet(tmp_path / "s.parquet").height == 4
