"""``kvsnap attention``, ``plot --attention`` and the attention statistics' options on a file
with queries (`tests.kvformat.test_queries` writes it): the map and its table, and each
selection outside the file refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvformat
from tests.kvformat.test_queries import _reference, _spec, _write


def test_attention_command_and_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import polars as pl

    from kvsnap.cli import main

    spec = _spec(window=8)
    data = _write(tmp_path / "q.kv", spec)
    assert spec.queries is not None
    out = tmp_path / "att.npz"
    assert main(["attention", str(tmp_path / "q.kv"), "--layer", "0", "--head", "2", "-o", str(out)]) == 0
    assert f"wrote {out}: layer 0 query head 2, 20 queries x 40 keys" in capsys.readouterr().out
    with np.load(out) as saved:
        expected = _reference(data, spec.queries, 2, saved["query_positions"])
        np.testing.assert_allclose(saved["weights"], expected, rtol=1e-5, atol=1e-6)
    table = tmp_path / "att.parquet"
    args = ["attention", str(tmp_path / "q.kv"), "--layer", "0", "--head", "2", "--queries", "30:32"]
    assert main([*args, "-o", str(table)]) == 0
    long = pl.read_parquet(table)
    assert set(long["query_position"].to_list()) == {30, 31} and long.height == 2 * 8  # the window
    assert main([*args, "-o", str(table)]) == 2  # exists
    png = tmp_path / "map.png"
    assert main(["plot", str(tmp_path / "q.kv"), "--attention", "0:3", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        main(["attention", str(tmp_path / "q.kv"), "--layer", "0", "--head", "9", "-o", str(out), "--force"])
        == 2
    )
    with pytest.raises(SystemExit) as refused:  # argparse: usage and exit status 2
        main(
            [
                "attention",
                str(tmp_path / "q.kv"),
                "--layer",
                "0",
                "--head",
                "0",
                "--queries",
                "9:3",
                "-o",
                "x",
            ]
        )
    assert refused.value.code == 2


def test_selections_and_indices_outside_the_file_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layer out of range, or a query or key range that selects nothing the file stores: one
    line naming what the file holds, exit 2, nothing written; `OutOfRangeError` from Python."""
    from kvsnap.cli import main

    path = tmp_path / "q.kv"
    _write(path, _spec(window=8))
    capsys.readouterr()
    out = tmp_path / "att.npz"
    cases = {
        ("--layer", "5", "--head", "0"): "layer 5 out of range 0..1",
        ("--layer", "0", "--head", "0", "--queries", "100:200"): "--queries 100:200 selects none of the "
        "queries layer 0 stores for query head 0 (positions 20..39)",
        ("--layer", "0", "--head", "0", "--keys", "50:60"): "--keys 50:60 selects none of the keys",
    }
    for options, message in cases.items():
        assert main(["attention", str(path), *options, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not out.exists()
    assert main(["plot", str(path), "--attention", "7:0", "-o", str(tmp_path / "m.png")]) == 2
    assert "layer 7 out of range 0..1" in capsys.readouterr().err
    with kvformat.open(path) as snap, pytest.raises(kvformat.OutOfRangeError, match="layer 7 out of range"):
        snap.attention(7, 0)
    with pytest.raises(SystemExit):
        main(["stats", str(path), "--stats", "atention"])
    assert "choose from all, norms, channels, rope, spectrum, quant, attention" in capsys.readouterr().err
    assert main(["outliers", str(path), "--stat", "sink_mass", "--threshold", "1.0"]) == 0
    assert "query heads with sink_mass above 1.0x" in capsys.readouterr().out
    assert main(["stats", str(path), "--needle", "0:4"]) == 2
    assert "--needle scores attention: use it with --stats attention" in capsys.readouterr().err


def test_pooled_keys_are_marked_in_the_outputs_and_the_map_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layer reading pooled keys (format 1.8, vector queries-pooled.kv: 10 own keys, 5 groups):
    ``kvsnap attention`` marks the pooled columns (``pooled_keys`` in the .npz, a ``pooled`` column
    in the table); ``plot --attention``, a map by key position, refuses it in one line."""
    import polars as pl

    from kvsnap.cli import main

    vector = str(Path(__file__).resolve().parents[3] / "spec" / "vectors" / "queries-pooled.kv")
    out, table = tmp_path / "att.npz", tmp_path / "att.parquet"
    assert main(["attention", vector, "--layer", "0", "--head", "1", "-o", str(out)]) == 0
    assert "10 queries x 15 keys, the last 5 pooled groups" in capsys.readouterr().out
    with np.load(out) as saved, kvformat.open(vector) as snap:
        assert int(saved["pooled_keys"]) == 5 and saved["key_positions"].tolist()[10:] == [0, 1, 2, 3, 4]
        np.testing.assert_array_equal(saved["weights"], snap.attention(0, 1).weights)
    assert main(["attention", vector, "--layer", "0", "--head", "1", "-o", str(table)]) == 0
    long = pl.read_parquet(table)
    pooled = long.filter(pl.col("pooled"))
    assert pooled.height and pooled["key_position"].max() <= 4
    assert (pooled["query_position"] + 1 >= (pooled["key_position"] + 1) * 2).all()  # whole groups only
    capsys.readouterr()
    assert main(["plot", vector, "--attention", "0:1", "-o", str(tmp_path / "map.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pooled keys" in err and not (tmp_path / "map.png").exists()
