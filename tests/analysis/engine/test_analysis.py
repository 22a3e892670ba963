"""Streaming per-head norm statistics equal a direct whole-array computation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

import kvformat
from kvsnap.analysis.engine.batch import head_stats
from kvsnap.analysis.engine.tables import head_stats_reader, head_stats_table
from kvsnap.analysis.stats.outliers import outliers
from kvsnap.cli import main
from tests.factories import random_file


def test_the_three_front_doors_give_the_same_rows(tmp_path: Path) -> None:
    """Per-head statistics as Polars (`head_stats`), one Arrow table (`head_stats_table`) and a
    stream of Arrow batches (`head_stats_reader`): the same rows, columns and values."""
    paths = [random_file(tmp_path / f"{i}.kv", seed=i).path for i in range(2)]
    frame = head_stats(paths, jobs=1)
    table = head_stats_table(paths, jobs=1)
    streamed = head_stats_reader(paths, jobs=1).read_all()
    assert frame.height == table.num_rows == streamed.num_rows > 0
    assert pl.from_arrow(table).equals(frame) and pl.from_arrow(streamed).equals(frame)


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


def make_files(tmp_path: Path, count: int = 3) -> list[str]:
    """Files of two layers of four 8-channel heads, head 3 an outlier (K x 8), layer 1 a half-scale
    copy of layer 0 (CKA 1 across layers)."""
    return [
        str(
            random_file(
                tmp_path / f"f{i}.kv",
                layers=2,
                heads=4,
                tokens=30 + i,
                dim=8,
                seed=5 + i,
                outlier_head=(3, 8.0),
                v="k_prefix",
                v_dim=4,
                copies=0.5,
            ).path
        )
        for i in range(count)
    ]


def test_jobs_give_the_same_table_as_one_process(tmp_path: Path) -> None:
    paths = make_files(tmp_path)
    one, many = head_stats(paths), head_stats(paths, jobs=2)
    assert one.height == 3 * 2 * 4 * 2
    assert one.equals(many)
    assert one["file"].unique(maintain_order=True).to_list() == paths


def test_stats_for_file_yields_arrow_tables(tmp_path: Path) -> None:
    import pyarrow as pa

    from kvsnap.analysis.engine.tables import stats_for_file, stats_rows

    path = make_files(tmp_path, 1)[0]
    tables = list(stats_for_file(path))
    assert all(isinstance(t, pa.Table) for t in tables) and len(tables) == 2  # one per layer
    assert sum(t.num_rows for t in tables) == len(stats_rows(path))


def test_outliers_command_prints_the_flagged_heads(tmp_path: Path, capsys: object) -> None:
    paths = make_files(tmp_path, 2)
    assert main(["outliers", *paths, "--stat", "norm_mean", "--tensor", "k", "--threshold", "3"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert out.startswith("4 heads with k norm_mean above 3.0x")
    rows = [line.split() for line in out.splitlines()[2:]]
    assert {(r[2], r[3]) for r in rows} == {("0", "3"), ("1", "3")}
    assert all(float(r[5]) > 3 for r in rows)
    # Refused before any pass, in one line with exit status 2.
    assert main(["outliers", paths[0], "--stat", "eigenvalues"]) == 2
    assert "holds a list per head" in capsys.readouterr().err  # type: ignore[attr-defined]
    assert main(["outliers", paths[0], "--stat", "norm_man"]) == 2
    assert "no such statistic" in capsys.readouterr().err  # type: ignore[attr-defined]
    assert main(["plot", paths[0], "--stat", "norm_mean", "--stats", "channels", "-o", "x.png"]) == 2
    assert "in the 'norms' group, which --stats leaves out" in capsys.readouterr().err  # type: ignore[attr-defined]
    assert main(["stats", paths[0], "--snapshot", "7"]) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert len(err.strip().splitlines()) == 1 and "snapshot 7 out of range" in err


def test_plot_and_similarity_commands(tmp_path: Path, capsys: object) -> None:
    path = make_files(tmp_path, 1)[0]
    png = tmp_path / "h.png"
    assert main(["plot", path, "--stat", "norm_max", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["similarity", path, "-o", str(tmp_path / "sim.parquet"), "--top", "2"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "2 layers x 4 heads" in out
    assert "most similar across layers" in out
    table = pl.read_parquet(tmp_path / "sim.parquet")
    across = table.filter((pl.col("kind") == "layer") & (pl.col("tensor") == "k"))
    assert across["cka"].to_list() == [1.0] * 4 or np.allclose(across["cka"].to_list(), 1.0)  # k * 0.5
    assert table.filter(pl.col("kind") == "head").height == 2 * 2 * 6  # 2 layers, k and v, 6 pairs


def test_statistic_groups_select_columns_and_keep_their_values(tmp_path: Path) -> None:
    """Each group computes its columns only (the others absent, not NaN), with the values the
    full catalogue gives; unknown names are refused naming the choices."""
    from kvsnap.analysis.stats import GROUPS, stat_groups

    paths = make_files(tmp_path, 1)
    full = head_stats(paths)
    for group, columns in GROUPS.items():
        part = head_stats(paths, stats=group)
        assert set(part.columns) == {
            "file",
            "snapshot",
            "seq",
            "layer",
            "head",
            "tensor",
            "n_tokens",
            "nonfinite_rows",
            "nonfinite_values",
            *columns,
        }
        for column in columns:
            assert part[column].to_list() == full[column].to_list(), column
    pair = head_stats(paths, stats="norms,channels")
    assert {"norm_mean", "channel_kurtosis"} <= set(pair.columns) and "eigenvalues" not in pair.columns
    assert stat_groups("all") == stat_groups(None) == frozenset(GROUPS)
    for bad in ("norm", "", "norms,spectra"):
        with pytest.raises(ValueError, match="choose from all, norms"):
            stat_groups(bad)


def test_stats_option_and_jobs_are_checked_when_parsed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = make_files(tmp_path, 1)
    for flags, message in (
        (["--stats", "spectra"], "unknown statistic group 'spectra'"),
        (["--jobs", "0"], "--jobs: must be at least 1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["stats", *paths, *flags])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert main(["stats", *paths, "--stats", "spectrum,quant", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "median over heads" in out and "effective_rank=" in out and "norm_mean" not in out


def test_one_file_over_threads_equals_one_thread(tmp_path: Path) -> None:
    """Many chunks per head (each head's adds in order on whatever thread), several layers."""
    rng = np.random.default_rng(9)
    layers = []
    for scale in (1.0, 3.0, 0.2):
        k = (rng.standard_normal((4, 700, 32)) * scale).astype(np.float32)
        layers.append(kvformat.Layer(k, k[:, :, :16].copy()))
    path = tmp_path / "threads.kv"
    kvformat.save(path, layers, chunk_bytes=100 * 32 * 4)
    one = head_stats(path, jobs=1)
    for jobs in (2, 3, 8):
        assert head_stats(path, jobs=jobs).equals(one), jobs


def test_split_jobs() -> None:
    from kvsnap.analysis.engine.parallel import split_jobs

    assert split_jobs(16, 1) == (1, 16)
    assert split_jobs(16, 4) == (4, 4)
    assert split_jobs(16, 200) == (16, 1)
    assert split_jobs(3, 2) == (2, 1)
    with pytest.raises(ValueError, match="at least 1"):
        split_jobs(0, 3)


def test_plot_is_labelled_for_a_paper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A title naming file, model, snapshot and statistic; labelled colour
    scales (the statistic, the layers); the prompt/generation boundary; token labels."""
    import matplotlib.figure

    rng = np.random.default_rng(0)
    spec = kvformat.LayerSpec(2, 16, 16, kvformat.FLOAT32)
    path = tmp_path / "run.kv"
    pieces = [f"t{i}" for i in range(30)]
    with kvformat.Writer(path, [spec] * 3, metadata={"model": {"name": "tiny-test-model"}}) as writer:
        for layer in range(3):
            data = rng.standard_normal((2, 20, 16)).astype(np.float32)
            writer.append(layer, data, data)
        writer.snapshot({"generated": 0, "tokens": [list(range(20))], "token_pieces": [pieces[:20]]})
        for layer in range(3):
            data = rng.standard_normal((2, 10, 16)).astype(np.float32)
            writer.append(layer, data, data)
        appended = {"tokens_appended": [list(range(20, 30))], "token_pieces_appended": [pieces[20:]]}
        writer.snapshot({"generated": 10, **appended})
    figures: list[matplotlib.figure.Figure] = []

    def record(self: matplotlib.figure.Figure, path: str, *args: object, **kwargs: object) -> None:
        figures.append(self)
        open(path, "wb").close()  # the command renames what it saved into place

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    png = str(tmp_path / "p.png")
    assert main(["plot", str(path), "--stat", "norm_max", "--token-labels", "-o", png]) == 0
    figure = figures[0]
    title = figure.texts[0].get_text()  # the suptitle
    for part in ("run.kv", "tiny-test-model", "snapshot 1 (of 0..1)", "K norm_max"):
        assert part in title, title
    _, curves, heat_bar, layer_bar = figure.axes
    assert heat_bar.get_ylabel() == "K norm_max" and layer_bar.get_ylabel() == "layer"
    assert layer_bar.get_ylim() == (0.0, 2.0)  # the layer scale spans the layers
    boundary = [line.get_xdata()[0] for line in curves.get_lines() if line.get_linestyle() == "--"]
    assert boundary == [19.5]  # 20 prompt tokens, then the generated ones
    assert [t.get_text() for t in curves.get_xticklabels()][:3] == ["t0", "t1", "t2"]
    assert len(curves.get_lines()) == 3 + 1  # one line per layer, plus the boundary


@pytest.mark.parametrize(
    "column",
    [
        [True, False, True, True, False, False, False, False, True],  # a bitmap over 2 bytes
        [False],
        [1, 2, 3],
        [0.5, None, 2.0],
        ["a", "bc", ""],
        [[1.0, 2.0], [], [3.0]],
    ],
)
def test_arrow_columns_equal_pyarrows_own(column: list[object]) -> None:
    """`arrow_column` (numpy buffers, no pandas) gives what ``pa.array`` gives."""
    import pyarrow as pa

    from kvsnap.analysis.stats.arrow import arrow_column

    built = arrow_column(column)
    assert built.equals(pa.array(column)) and built.to_pylist() == column
