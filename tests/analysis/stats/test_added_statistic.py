"""A statistic added as a user adds one: one module of their own and an entry point in their
package's metadata (here a folder on ``sys.path`` holding both). Every backend computes it,
merges keep it exact, the command line offers it, and a fresh ``kvsnap`` process finds it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from kvformat.errors import InvalidArgumentError, UnknownNameError
from kvsnap.analysis.engine.batch import head_stats
from kvsnap.analysis.stats import statistic
from kvsnap.analysis.stats.catalogue import Sum
from tests.factories import random_file

# The whole of what a user writes: the statistics (one module) ...
MODULE = """
import numpy as np

from kvsnap.analysis.stats.catalogue import Sum
from kvsnap.analysis.stats.statistic import Statistic


def add_abs(sums, rows, positions):
    sums["abs_sum"] += np.abs(rows).sum(axis=0)


def add_low(sums, rows, positions):
    np.minimum(sums["channel_low"], rows.min(axis=0), out=sums["channel_low"])


def add_late(sums, rows, positions):
    sums["late_count"] += np.count_nonzero(positions >= 64)


STATISTIC = (
    Statistic("channel_absmean", "channels", (Sum("abs_sum", "add", frozenset({"channels"}), ("dim",)),),
              add_abs, lambda sums: sums["abs_sum"] / sums["count"], vector=True),
    Statistic("channel_lowest", "channels", (Sum("channel_low", "min", frozenset({"channels"}), ("dim",)),),
              add_low, lambda sums: sums["channel_low"], vector=True),
    Statistic("late_fraction", "norms", (Sum("late_count", "add", frozenset({"norms"}), dtype="int64"),),
              add_late, lambda sums: float(sums["late_count"]) / sums["count"]),
)
"""
# ... and one entry point in the package's metadata.
ENTRY_POINTS = "[kvsnap.statistics]\nextra = extra_statistics:STATISTIC\n"


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The user's installed package: a folder on ``sys.path`` with the module and its metadata."""
    root = tmp_path_factory.mktemp("site")
    (root / "extra_statistics.py").write_text(MODULE)
    info = root / "extra_statistics-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: extra-statistics\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    sys.path.insert(0, str(root))
    statistic.added.cache_clear()
    yield root
    sys.path.remove(str(root))
    sys.modules.pop("extra_statistics", None)
    statistic.added.cache_clear()


def expected(k: np.ndarray, positions: np.ndarray) -> dict[str, object]:
    x = k.astype(np.float64)
    return {
        "channel_absmean": np.abs(x).mean(axis=0),
        "channel_lowest": x.min(axis=0),
        "late_fraction": float(np.mean(positions >= 64)),
    }


@pytest.mark.parametrize("backend", ["numpy", "cpu", "mlx"])
def test_every_backend_computes_an_added_statistic(package: Path, tmp_path: Path, backend: str) -> None:
    made = random_file(tmp_path / "one.kv", seed=3, chunk_bytes=1 << 12)  # several chunks a head
    table = head_stats(tmp_path / "one.kv", jobs=1, backend=backend)
    assert {"channel_absmean", "channel_lowest", "late_fraction"} <= set(table.columns)
    for row in table.filter(pl.col("tensor") == "k").iter_rows(named=True):
        rows = made.k[row["layer"]][row["head"]]
        want = expected(rows, np.arange(rows.shape[0]))
        np.testing.assert_allclose(row["channel_absmean"], want["channel_absmean"], rtol=1e-12)
        np.testing.assert_array_equal(row["channel_lowest"], want["channel_lowest"])
        assert row["late_fraction"] == want["late_fraction"]


def test_an_added_statistic_merges_exactly_over_files(package: Path, tmp_path: Path) -> None:
    first = random_file(tmp_path / "a.kv", seed=1)
    second = random_file(tmp_path / "b.kv", seed=2)
    table = head_stats([tmp_path / "a.kv", tmp_path / "b.kv"], merge=True, jobs=1)
    row = table.filter((pl.col("tensor") == "k") & (pl.col("head") == 0)).row(0, named=True)
    both = np.concatenate([first.k[0][0], second.k[0][0]])
    positions = np.concatenate([np.arange(first.k[0].shape[1])] * 2)
    want = expected(both, positions)
    np.testing.assert_allclose(row["channel_absmean"], want["channel_absmean"], rtol=1e-12)
    np.testing.assert_array_equal(row["channel_lowest"], want["channel_lowest"])
    assert row["late_fraction"] == want["late_fraction"]


def test_the_command_line_offers_it(package: Path) -> None:
    statistic.check_scalar("late_fraction", frozenset({"norms"}))
    with pytest.raises(InvalidArgumentError, match="list per head"):
        statistic.check_scalar("channel_absmean", frozenset({"channels"}))
    with pytest.raises(InvalidArgumentError, match="'norms' group"):
        statistic.check_scalar("late_fraction", frozenset({"channels"}))
    with pytest.raises(UnknownNameError, match="late_fraction"):  # the choices name it
        statistic.check_scalar("late_fractions", frozenset({"norms"}))


def test_a_fresh_kvsnap_process_finds_it(package: Path, tmp_path: Path) -> None:
    made = random_file(tmp_path / "one.kv", seed=4)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "stats.parquet"
    subprocess.run(
        [sys.executable, "-m", "kvsnap", "stats", str(tmp_path / "one.kv"), "-o", str(out),
         "--stats", "norms"], check=True, env=env, capture_output=True,
    )  # fmt: skip
    table = pl.read_parquet(out)
    assert "late_fraction" in table.columns and "channel_absmean" not in table.columns  # --stats norms
    assert (
        table["late_fraction"].to_list()
        == [float(np.mean(np.arange(made.k[0].shape[1]) >= 64))] * table.height
    )


def test_a_declaration_that_clashes_is_refused(package: Path) -> None:
    def add(sums: object, rows: object, positions: object) -> None:
        pass

    def value(sums: object) -> float:
        return 0.0

    taken = Sum("power", "add", frozenset({"norms"}))
    fresh = Sum("fresh", "add", frozenset({"norms"}))
    with pytest.raises(InvalidArgumentError, match="catalogue"):
        statistic.register(statistic.Statistic("norm_mean", "norms", (fresh,), add, value))
    with pytest.raises(InvalidArgumentError, match="declared already"):
        statistic.register(statistic.Statistic("mine", "norms", (taken,), add, value))
    with pytest.raises(UnknownNameError, match="no group"):
        statistic.register(statistic.Statistic("mine", "nowhere", (fresh,), add, value))
    with pytest.raises(InvalidArgumentError, match="merges by"):
        statistic.register(
            statistic.Statistic("mine", "norms", (Sum("fresh", "top", frozenset()),), add, value)
        )
    assert "mine" not in statistic.added()
