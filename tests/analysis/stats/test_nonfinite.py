"""Non-finite values are data, not failures: a row holding inf or NaN is left out of
every statistic of its head and counted, on every backend; the statistics of the other rows equal
those of a file that never held the bad rows; nothing warns; `outliers` ignores NaN; `diff` names
positions that are non-finite on one side."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import kvformat
from kvsnap.analysis.engine.batch import head_stats
from kvsnap.analysis.engine.tables import stats_rows
from kvsnap.analysis.kernels import kernel
from kvsnap.analysis.kernels import mlx as mlx_backend
from kvsnap.analysis.stats import finite
from kvsnap.analysis.tools.token_table import token_table
from kvsnap.cli import main

TOKENS, DIM = 200, 16
PLACES = {
    "first": [(0, 3)],  # (row, channel)
    "last": [(TOKENS - 1, 0)],
    "inside": [(57, 5), (58, 5), (120, 15)],
    "whole_head": [(row, 0) for row in range(TOKENS)],
}
VALUES = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, TOKENS, DIM)).astype(np.float32), rng.standard_normal((2, TOKENS, DIM))


def _files(tmp_path: Path, place: str, value: float, dtype: Any) -> tuple[Path, Path, list[int]]:
    """A file whose layer-0 head 1 K holds ``value`` at ``place`` (V of head 0 too), and the same
    data written without the bad rows (positions kept)."""
    k, v = _data()
    v = v.astype(np.float32)
    bad = sorted({row for row, _ in PLACES[place]})
    for row, channel in PLACES[place]:
        k[1, row, channel] = value
        v[0, row, channel] = value
    path = tmp_path / f"bad-{place}.kv"
    kvformat.save(path, [kvformat.Layer(k.astype(dtype), v.astype(dtype))])
    keep = np.setdiff1d(np.arange(TOKENS), bad)
    # The reference: each (head, tensor) as a one-head layer of its own, its bad rows left out
    # (positions kept): layer 0 = K head 0, 1 = K head 1, 2 = V head 0, 3 = V head 1.
    everything = np.arange(TOKENS)
    parts = [(k[0], everything), (k[1][keep], keep), (v[0][keep], keep), (v[1], everything)]
    reference = tmp_path / f"ref-{place}.kv"
    kvformat.save(
        reference,
        [
            kvformat.Layer(rows[None].astype(dtype), rows[None].astype(dtype), positions=p)
            for rows, p in parts
        ],
    )
    return path, reference, bad


def _pick(rows: list[dict[str, Any]], layer: int, head: int, tensor: str) -> dict[str, Any]:
    return next(r for r in rows if r["layer"] == layer and r["head"] == head and r["tensor"] == tensor)


def _same(got: dict[str, Any], expected: dict[str, Any], rtol: float) -> None:
    for column, value in expected.items():
        if column in (
            "layer",
            "head",
            "tensor",
            "file",
            "snapshot",
            "seq",
            "nonfinite_rows",
            "nonfinite_values",
        ):
            continue
        other = got[column]
        if value is None or other is None:
            assert value is None and other is None, column
            continue
        np.testing.assert_allclose(
            np.asarray(other, np.float64), np.asarray(value, np.float64), rtol=rtol, atol=1e-9, err_msg=column
        )


BACKENDS = ["compiled", "numpy"] + (["mlx"] if mlx_backend.available() else [])


@pytest.mark.filterwarnings("error")  # no numpy warning reaches the user
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("value", list(VALUES))
def test_rows_with_nonfinite_values_are_left_out_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, place: str, value: str
) -> None:
    monkeypatch.setattr(kernel, "AVAILABLE", backend != "numpy")
    path, reference, bad = _files(tmp_path, place, VALUES[value], np.float32)
    chosen = "mlx" if backend == "mlx" else "cpu"
    got = stats_rows(path, backend=chosen)
    expected = stats_rows(reference, backend=chosen)
    rtol = mlx_backend.TOLERANCES["quantile"] if backend == "mlx" else 1e-9
    for head, tensor, ref_layer in ((1, "k", 1), (0, "v", 2)):
        row = _pick(got, 0, head, tensor)
        assert row["nonfinite_rows"] == len(bad)
        assert row["nonfinite_values"] == len(PLACES[place])
        assert row["n_tokens"] == TOKENS - len(bad)
        ref = _pick(expected, ref_layer, 0, tensor)
        if place == "whole_head":
            assert row.get("norm_mean") is None  # nothing left to describe
        else:
            _same(row, ref, rtol)
    clean = _pick(got, 0, 0, "k")
    assert clean["nonfinite_rows"] == 0 and clean["n_tokens"] == TOKENS
    _same(clean, _pick(expected, 0, 0, "k"), rtol)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_the_exponent_test_finds_every_nonfinite_value(dtype: Any) -> None:
    rows = np.random.default_rng(1).standard_normal((50_000, 8)).astype(dtype)
    assert finite.bad_rows(rows) is None and not finite.any_nonfinite(rows)
    rows[7, 2], rows[49_999, 0], rows[30_000, 7] = np.inf, -np.inf, np.nan
    bad = finite.bad_rows(rows)
    assert bad is not None and sorted(np.flatnonzero(bad).tolist()) == [7, 30_000, 49_999]
    assert finite.count_values(rows) == 3
    # huge but finite float32 values (their squares overflow): a false alarm the exact test clears
    big = np.full((4, 4), 3e38, np.float32)
    assert finite.any_nonfinite(big) and finite.bad_rows(big) is None


def test_cli_stats_and_outliers_on_a_file_with_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, _ = _files(tmp_path, "inside", np.nan, np.float16)
    out = tmp_path / "stats.parquet"
    assert main(["stats", str(path), "-o", str(out)]) == 0
    text = capsys.readouterr()
    assert "nan" not in text.out.lower() and "Warning" not in text.err
    import polars as pl

    table = pl.read_parquet(out)
    assert table.filter(pl.col("nonfinite_rows") > 0).height == 2
    assert main(["outliers", str(path), "--stat", "norm_mean"]) == 0
    assert "nan" not in capsys.readouterr().out.lower()


def test_cli_stats_prints_a_whole_nan_head_as_null_and_ranks_it_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The printout (built from Arrow rows, `key_rows`) gives every K head the ratio
    `stats.outliers` (polars) gives it; the head with nothing finite prints as null, its ratio as
    n/a, ranked after every finite one."""
    import polars as pl

    from kvsnap.analysis.commands.statistics import key_rows
    from kvsnap.analysis.engine.tables import rows_of
    from kvsnap.analysis.stats.outliers import outliers

    path, _, _ = _files(tmp_path, "whole_head", np.nan, np.float32)
    assert main(["stats", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "null" in printed and "nan" not in printed.lower()
    largest = printed.split("largest:")[1]  # head 1's K is all NaN: ranked after head 0
    assert "layer 0 head 0 (1.00x median)" in largest and "layer 0 head 1 (n/a median)" in largest
    assert largest.index("head 0") < largest.index("head 1")
    table = head_stats(path)
    expected = {
        (r["layer"], r["head"]): r["ratio_to_median"] for r in outliers(table, 1.5).iter_rows(named=True)
    }
    got = {(r["layer"], r["head"]): r["ratio_to_median"] for r in key_rows(rows_of([table.to_arrow()]), 1.5)}
    assert got.keys() == expected.keys()
    for key, ratio in expected.items():
        assert (got[key] is None) == (ratio is None), key
        if ratio is not None:
            assert got[key] == pytest.approx(ratio, rel=1e-12)
    assert pl.Series([v for v in got.values() if v is not None]).is_finite().all()


def test_a_whole_nan_head_does_not_poison_the_outlier_medians(tmp_path: Path) -> None:
    from kvsnap.analysis.stats.outliers import outliers

    path, _, _ = _files(tmp_path, "whole_head", np.nan, np.float32)
    table = head_stats(path)
    flagged = outliers(table, 1.5)
    k = flagged.filter((flagged["tensor"] == "k") & (flagged["head"] == 0))
    ratio = k["ratio_to_median"][0]
    assert ratio is not None and np.isfinite(ratio)


def test_token_table_counts_nonfinite_values_per_position(tmp_path: Path) -> None:
    path, _, bad = _files(tmp_path, "inside", np.inf, np.float32)
    tokens = token_table(path).collect()
    import polars as pl

    hit = tokens.filter(pl.col("k_nonfinite") > 0)
    assert sorted(set(hit["position"].to_list())) == bad
    assert all(v is None or np.isfinite(v) for v in tokens["k_norm"].to_list())


def test_diff_reports_positions_nonfinite_on_one_side(tmp_path: Path) -> None:
    from kvsnap.analysis.tools.diff import head_diff

    k, v = _data()
    a = tmp_path / "a.kv"
    kvformat.save(a, [kvformat.Layer(k, v.astype(np.float32))])
    k[1, 42, 3] = np.nan
    b = tmp_path / "b.kv"
    kvformat.save(b, [kvformat.Layer(k, v.astype(np.float32))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = head_diff(a, b)
    row = table.filter((table["tensor"] == "k") & (table["head"] == 1)).row(0, named=True)
    assert row["nonfinite_positions"] == [42]
    assert row["first_divergent_position"] == 42
    assert np.isfinite(row["rel_error"])  # over the positions finite on both sides
    clean = table.filter((table["tensor"] == "k") & (table["head"] == 0)).row(0, named=True)
    assert clean["nonfinite_positions"] == [] and clean["rel_error"] == 0.0


def test_imported_go_mlx_fixture_with_nonfinite_values(tmp_path: Path) -> None:
    """The repository's go-mlx fixture that failed `kvsnap stats`."""
    source = Path(__file__).resolve().parents[2] / "mlxkv" / "mixed-tags.mlxkv"
    out = tmp_path / "mixed.kv"
    kvformat.import_mlxkv(source, out)
    result = subprocess.run(
        [sys.executable, "-m", "kvsnap.cli", "stats", str(out)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr and "LinAlgError" not in result.stderr
    assert "nanx" not in result.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_quantized_layer_with_an_inf_scale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """A quantized layer whose one group scale overflowed: that token's dequantized K row is inf
    there, left out and counted; the other tokens' statistics are those of the finite rows."""
    from kvformat.quantization import Quantization

    monkeypatch.setattr(kernel, "AVAILABLE", backend != "numpy")
    q = Quantization(bits=4, group_size=32)
    rng = np.random.default_rng(5)
    words, groups = q.widths(64)
    parts = [
        (
            rng.integers(0, 2**32, (1, 12, words), dtype=np.uint32),
            rng.uniform(0.1, 1.0, (1, 12, groups)).astype(np.float16),
            rng.standard_normal((1, 12, groups)).astype(np.float16),
        )
        for _ in range(2)
    ]
    parts[0][1][0, 7, 1] = np.inf  # token 7, channels 32..63 of K
    path = tmp_path / "quantized.kv"
    with kvformat.Writer(path, [kvformat.LayerSpec(1, 64, 64, kvformat.FLOAT16, quantization=q)]) as writer:
        writer.append(0, parts[0], parts[1])
    with kvformat.open(path) as snap:
        data = snap.head(0, 0)
        assert data is not None
        k = data.k.astype(np.float32)
    assert not np.isfinite(k[7]).all() and np.isfinite(np.delete(k, 7, axis=0)).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = stats_rows(path, backend="mlx" if backend == "mlx" else "cpu")
    row = _pick(rows, 0, 0, "k")
    assert row["nonfinite_rows"] == 1 and row["n_tokens"] == 11
    assert row["nonfinite_values"] == int((~np.isfinite(k[7])).sum())
    kept = np.delete(k, 7, axis=0).astype(np.float64)
    np.testing.assert_allclose(row["norm_mean"], np.linalg.norm(kept, axis=1).mean(), rtol=1e-4)
    assert _pick(rows, 0, 0, "v")["nonfinite_rows"] == 0


def test_a_head_of_zero_vectors_has_no_sink_ratio_and_no_error(tmp_path: Path) -> None:
    """A head whose every vector is 0 (a sparse-attention indexer's cache stores zeros as its
    values): ``sink_ratio`` is 0 / 0, NaN, and the rest of the row is computed."""
    import kvsnap

    k = np.random.default_rng(3).standard_normal((1, 6, 8)).astype(np.float32)
    path = tmp_path / "zeros.kv"
    kvformat.save(path, [kvformat.Layer(k, np.zeros_like(k))])
    table = kvsnap.head_stats(path)
    values = table.filter(table["tensor"] == "v").row(0, named=True)
    keys = table.filter(table["tensor"] == "k").row(0, named=True)
    assert values["norm_mean"] == 0.0 and math.isnan(values["sink_ratio"])
    assert math.isfinite(keys["sink_ratio"]) and keys["sink_ratio"] > 0
