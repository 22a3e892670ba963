"""Nothing a user types loses data: every command refuses an existing output without
``--force`` and its own input even with it, writes through a temporary name (a failure leaves
nothing), says the exact path it wrote; `recover` only reads its input; an unguarded script runs
batch statistics once."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat.io.outputs import OutputExistsError, SameAsInputError
from kvsnap.cli import main
from tests import factories


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _only(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    path = tmp_path / "run.kv"
    factories.random_file(path, layers=2, heads=2, tokens=64, dim=16)
    return path


def _corrupt(source: Path, target: Path) -> Path:
    """A copy of ``source`` with one payload byte flipped (its CRC then fails)."""
    data = bytearray(source.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the K/V records (the index is at the end)
    target.write_bytes(bytes(data))
    return target


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as exc:  # what the console script turns into its exit status
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


COMMANDS = {
    "stats": lambda f, o: ["stats", f, "-o", o],
    "diff": lambda f, o: ["diff", f, f, "-o", o],
    "diff-plot": lambda f, o: ["diff", f, f, "--plot", o],
    "similarity": lambda f, o: ["similarity", f, "-o", o],
    "plot": lambda f, o: ["plot", f, "-o", o],
    "dump": lambda f, o: ["dump", f, "--layer", "0", "--head", "0", "-o", o],
}
EXTENSION = {
    "stats": ".parquet",
    "diff": ".csv",
    "diff-plot": ".svg",
    "similarity": ".parquet",
    "plot": ".pdf",
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_existing_output_is_refused_then_replaced_with_force(
    command: str, capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / f"existing{EXTENSION.get(command, '.npz')}"
    output.write_bytes(b"keep me")
    code, _, err = _run(COMMANDS[command](str(capture), str(output)), capsys)
    assert code == 2 and "exists; replace it with --force" in err and len(err.strip().splitlines()) == 1
    assert output.read_bytes() == b"keep me"
    code, out, _ = _run([*COMMANDS[command](str(capture), str(output)), "--force"], capsys)
    assert code == 0 and output.read_bytes() != b"keep me"
    assert f"wrote {output}" in out  # the exact path
    assert _only(tmp_path) == {"run.kv", output.name}  # no temporary left


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_input_is_never_an_output_even_with_force(
    command: str, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _digest(capture)
    for extra in ([], ["--force"]):
        code, _, err = _run([*COMMANDS[command](str(capture), str(capture)), *extra], capsys)
        assert code == 2 and "is an input of this command" in err
    assert _digest(capture) == before
    with kvformat.open(capture) as snap:
        snap.verify()


def test_pack_import_recover_refuse_their_input_and_existing_outputs(
    tmp_path: Path, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    npz = tmp_path / "in.npz"
    rng = np.random.default_rng(0)
    np.savez(
        npz, k_L0=rng.standard_normal((2, 8, 4)).astype(np.float32), v_L0=np.zeros((2, 8, 4), np.float32)
    )
    assert _run(["pack", str(npz), str(npz), "--force"], capsys)[0] == 2
    assert _run(["pack", str(npz), str(capture)], capsys)[0] == 2
    assert _run(["pack", str(npz), str(tmp_path / "new.kv")], capsys)[0] == 0
    text = tmp_path / "notes.kv"
    text.write_text("hello")
    code, _, err = _run(["pack", str(text), str(tmp_path / "x.kv")], capsys)
    assert code == 2 and "pickle" not in err and "not an .npz" in err
    mlxkv = Path(__file__).resolve().parents[1] / "mlxkv" / "v6-slabs-float32.mlxkv"
    if mlxkv.exists():
        assert _run(["import-mlxkv", str(mlxkv), str(capture)], capsys)[0] == 2
    assert _run(["recover", str(capture), "-o", str(capture), "--force"], capsys)[0] == 2
    assert kvformat.open(capture).verify()


def test_dump_writes_the_exact_name_given(
    tmp_path: Path, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "foo.NPZ"  # numpy's savez would name it foo.NPZ.npz
    code, out, _ = _run(["dump", str(capture), "--layer", "0", "--head", "1", "-o", str(target)], capsys)
    assert code == 0 and target.exists() and not (tmp_path / "foo.NPZ.npz").exists()
    assert f"wrote {target}:" in out
    with np.load(target) as arrays:
        assert arrays["k"].shape == (64, 16)


def test_plot_into_a_folder_is_refused(
    tmp_path: Path, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "adir"
    folder.mkdir()
    code, _, err = _run(["plot", str(capture), "-o", str(folder)], capsys)
    assert code == 2 and "is a folder" in err
    assert not (tmp_path / "adir.png").exists()


def test_missing_output_folder_is_one_line(
    tmp_path: Path, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(["stats", str(capture), "-o", str(tmp_path / "nope" / "t.parquet")], capsys)
    assert code == 2 and "does not exist" in err


def test_python_api_refuses_to_overwrite(tmp_path: Path, capture: Path) -> None:
    layer = kvformat.Layer(np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 4), np.float32))
    with pytest.raises(OutputExistsError):
        kvformat.save(capture, [layer])
    with pytest.raises(OutputExistsError):
        kvformat.Writer(capture, [kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32)])
    kvformat.save(capture, [layer], overwrite=True)
    with kvformat.open(capture) as snap:
        assert snap.seq_len == 2
    with pytest.raises(SameAsInputError):
        kvformat.import_mlxkv(capture, capture, overwrite=True)


def test_a_writer_does_not_replace_a_file_that_appeared_meanwhile(tmp_path: Path) -> None:
    path = tmp_path / "late.kv"
    writer = kvformat.Writer(path, [kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32)])
    writer.append(0, np.ones((1, 3, 4), np.float32), np.ones((1, 3, 4), np.float32))
    path.write_bytes(b"someone else's file")
    with pytest.raises(OutputExistsError):
        writer.close()
    assert path.read_bytes() == b"someone else's file"
    assert Path(writer.partial_path).exists()  # the data is kept for `kvsnap recover -o`


# -- failures clean up -------------------------------------------------------------------------


def test_failed_commands_leave_nothing(
    tmp_path: Path, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _corrupt(capture, tmp_path / "bad.kv")
    with kvformat.open(bad) as snap, pytest.raises(kvformat.KVFormatError):
        snap.verify()
    before = _only(tmp_path)
    for args in (
        ["export", str(bad), "-o", str(tmp_path / "heads")],
        ["stats", str(bad), "-o", str(tmp_path / "s.parquet")],
        ["diff", str(capture), str(bad), "-o", str(tmp_path / "d.parquet")],
    ):
        code, _, _ = _run(args, capsys)
        assert code != 0, args
        assert _only(tmp_path) == before, args
    truncated = tmp_path / "cut.mlxkv"
    source = Path(__file__).resolve().parents[1] / "mlxkv" / "mixed-tags.mlxkv"
    truncated.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    before = _only(tmp_path)
    code, _, _ = _run(["import-mlxkv", str(truncated), str(tmp_path / "imp.kv")], capsys)
    assert code == 2 and _only(tmp_path) == before


def test_export_writes_only_its_own_files_into_a_folder(
    tmp_path: Path, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "heads"
    assert _run(["export", str(capture), "-o", str(out)], capsys)[0] == 0
    assert len(list(out.iterdir())) == 4
    (out / "mine.txt").write_text("x")
    first = (out / "L01-H01.csv").read_bytes()
    code, _, err = _run(["export", str(capture), "-o", str(out)], capsys)
    assert code == 2 and "L00-H00.csv exists" in err and len(err.strip().splitlines()) == 1
    assert (out / "mine.txt").read_text() == "x"
    (out / "L00-H00.csv").write_text("stale")
    assert _run(["export", str(capture), "-o", str(out), "--force", "--layer", "0"], capsys)[0] == 0
    assert _only(out) == {"mine.txt", "L00-H00.csv", "L00-H01.csv", "L01-H00.csv", "L01-H01.csv"}
    assert (out / "L00-H00.csv").read_text() != "stale"  # replaced: it is export's own file
    assert (out / "L01-H01.csv").read_bytes() == first  # not asked for: untouched


def test_export_into_its_inputs_folder_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = tmp_path / "sub"
    sub.mkdir()
    source = sub / "in.kv"
    factories.random_file(source, layers=1, heads=2, tokens=8, dim=4)
    (sub / "notes.txt").write_text("mine")
    digest = _digest(source)
    for fmt in ("csv", "npy"):
        code, _, err = _run(["export", str(source), "-o", str(sub), "--force", "--format", fmt], capsys)
        assert code == 0, err
        assert _digest(source) == digest and (sub / "notes.txt").read_text() == "mine"
    assert _only(sub) == {
        "in.kv",
        "notes.txt",
        *(f"L00-H0{h}.csv" for h in range(2)),
        *(f"L00-H0{h}.{part}.npy" for h in range(2) for part in ("k", "v", "positions")),
    }
    monkeypatch.chdir(sub)  # -o . : the folder one works in
    code, _, err = _run(["export", "in.kv", "-o", ".", "--force", "--format", "npz"], capsys)
    assert code == 0, err
    assert (sub / "L00-H01.npz").exists() and _digest(source) == digest
    assert not [p for p in sub.iterdir() if p.name.startswith(".tmp-")]


def test_export_never_replaces_its_input_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "L00-H00.npz"  # named as export's own output would be
    factories.random_file(source, layers=1, heads=1, tokens=8, dim=4)
    digest = _digest(source)
    code, _, err = _run(["export", str(source), "-o", str(tmp_path), "--force", "--format", "npz"], capsys)
    assert code == 2 and "is an input of this command" in err
    assert _digest(source) == digest


def test_a_folder_output_replaces_only_a_folder_of_its_own_files(tmp_path: Path) -> None:
    from kvformat.io.outputs import output_path

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("old")
    (folder / "notes.txt").write_text("mine")
    with (
        pytest.raises(OutputExistsError, match=r"notes\.txt"),
        output_path(folder, force=True, folder=True) as temporary,
    ):
        (Path(temporary) / "config.json").write_text("new")
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "config.json").read_text() == "old"
    (folder / "notes.txt").unlink()
    with output_path(folder, force=True, folder=True) as temporary:
        (Path(temporary) / "config.json").write_text("new")
    assert (folder / "config.json").read_text() == "new"


# -- recover -----------------------------------------------------------------------------------


def _partial(tmp_path: Path) -> tuple[Path, kvformat.Writer]:
    path = tmp_path / "cap.kv"
    writer = kvformat.Writer(path, [kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT32)])
    rng = np.random.default_rng(0)
    for step in range(3):
        data = rng.standard_normal((2, 5, 8)).astype(np.float32)
        writer.append(0, data, data)
        writer.snapshot({"step": step})
    return Path(writer.partial_path), writer


def _crash(writer: kvformat.Writer) -> None:
    writer._file.close()  # what a killed process leaves: the file, no index, the lock gone
    writer._pool.shutdown()
    writer._closed = True


def test_recover_leaves_its_input_byte_for_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    partial, writer = _partial(tmp_path)
    _crash(writer)
    with open(partial, "ab") as f:
        f.write(b"\x00" * 100)  # a torn last record
    before = _digest(partial)
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    out = elsewhere / "saved.kv"
    code, text, _ = _run(["recover", str(partial), "-o", str(out)], capsys)
    assert code == 0 and f"wrote {out}" in text and "3 snapshot(s)" in text
    assert _digest(partial) == before
    with kvformat.open(out) as snap:
        snap.verify()
        assert snap.num_snapshots == 3
    code, text, _ = _run(["recover", str(partial)], capsys)  # default name: without .partial
    assert code == 0 and (tmp_path / "cap.kv").exists() and partial.exists()
    assert _run(["recover", str(partial)], capsys)[0] == 2  # cap.kv exists now


def test_recover_of_a_complete_file_changes_nothing(
    tmp_path: Path, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _digest(capture)
    code, text, _ = _run(["recover", str(capture)], capsys)
    assert code == 0 and "complete and valid: nothing to recover" in text
    assert _digest(capture) == before and _only(tmp_path) == {"run.kv"}


def test_recover_of_a_complete_partial_finishes_the_rename(
    tmp_path: Path, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A writer stopped between its last fsync and the rename leaves a complete ``X.partial``
    (the crash test's kills land there now and then): `recover` writes ``X``, a copy, and reads
    its input only."""
    partial = tmp_path / "done.kv.partial"
    partial.write_bytes(capture.read_bytes())
    before = _digest(partial)
    code, text, _ = _run(["recover", str(partial)], capsys)
    out = tmp_path / "done.kv"
    assert code == 0 and f"wrote {out}" in text and _digest(partial) == before
    assert out.read_bytes() == capture.read_bytes()
    report = kvformat.recover(partial, tmp_path / "again.kv")
    with kvformat.open(capture) as snap:
        assert (report.chunks, report.snapshots) == (snap.num_chunks, snap.num_snapshots)
    assert report.bytes_dropped == 0 and not report.recovered_snapshot


def test_recover_refuses_a_live_writers_partial(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    partial, writer = _partial(tmp_path)
    code, _, err = _run(["recover", str(partial), "-o", str(tmp_path / "r.kv")], capsys)
    assert code == 2 and "live process" in err
    code, _, _ = _run(["recover", str(partial), "-o", str(tmp_path / "r.kv"), "--force"], capsys)
    assert code == 0
    writer.close()  # the capture goes on and finishes
    with kvformat.open(tmp_path / "cap.kv") as snap:
        assert snap.num_snapshots == 3


# -- scripts without a __main__ guard ------------------------------------------------------------


def test_unguarded_script_runs_batch_statistics_once(tmp_path: Path) -> None:
    for i in range(2):
        factories.random_file(tmp_path / f"f{i}.kv", layers=2, heads=2, tokens=48, dim=16, seed=i)
    marker = tmp_path / "runs.txt"
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import kvsnap
            with open({str(marker)!r}, "a") as f:
                f.write("run\\n")
            table = kvsnap.head_stats([{str(tmp_path / "f0.kv")!r}, {str(tmp_path / "f1.kv")!r}], jobs=2)
            one = kvsnap.head_stats([{str(tmp_path / "f0.kv")!r}, {str(tmp_path / "f1.kv")!r}], jobs=1)
            assert table.drop("file").equals(one.drop("file")), "tables differ"
            print("rows", table.height)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rows 16" in result.stdout
    assert marker.read_text().count("run") == 1


def test_convert_gguf_names_a_bad_file_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    code, _, err = _run(["convert-gguf", str(bad), str(tmp_path / "model")], capsys)
    assert code == 2 and f"{bad}: not a readable GGUF file" in err
    assert _only(tmp_path) == {"notes.gguf"}


def test_diff_plot_title_names_what_was_compared(
    tmp_path: Path, capture: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import matplotlib.figure

    titles: list[str] = []

    def record(self: matplotlib.figure.Figure, path: str, *args: object, **kwargs: object) -> None:
        titles.append(self._suptitle.get_text() if self._suptitle is not None else "")
        open(path, "wb").close()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    plot = tmp_path / "d.png"
    assert _run(["diff", str(capture), str(capture), "--plot", str(plot)], capsys)[0] == 0
    assert titles == ["A = run.kv (snapshot 0 of 0..0), B = run.kv (snapshot 0 of 0..0); "
                      "up to 64 positions compared per head (post_rope keys)"]  # fmt: skip


FORMATS = {  # command: (its arguments before -o, the extensions it writes)
    "stats": (["stats", "{f}"], ["parquet", "csv"]),
    "simulate": (["simulate", "{q}", "--method", "streaming"], ["parquet", "csv"]),
    "attention": (["attention", "{q}", "--layer", "0", "--head", "0"], ["npz", "parquet", "csv"]),
    "plot": (["plot", "{f}"], ["png", "svg", "pdf"]),
    "dump": (["dump", "{f}", "--layer", "0", "--head", "0"], ["npz"]),
}
MAGIC = {"parquet": b"PAR1", "npz": b"PK\x03\x04", "png": b"\x89PNG", "svg": b"<?xml", "pdf": b"%PDF"}


@pytest.fixture
def with_queries(tmp_path: Path) -> Path:
    from tests.analysis.attention.test_head_importance import SPECS, _write

    path = tmp_path / "q.kv"
    _write(path, SPECS["causal"])
    return path


@pytest.mark.parametrize("command", list(FORMATS))
def test_each_output_is_written_in_the_format_its_name_says_or_refused(
    command: str, capture: Path, with_queries: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every format a command lists is written as its extension says (checked by the file's own
    first bytes, CSV by its header); any other extension, or none, is refused in one line before
    any work, nothing written."""
    before, formats = FORMATS[command]
    argv = [a.format(f=str(capture), q=str(with_queries)) for a in before]
    for form in formats:
        out = tmp_path / f"out.{form}"
        code, _, err = _run([*argv, "-o", str(out)], capsys)
        assert code == 0, err
        head = out.read_bytes()[:8]
        if form == "csv":
            assert out.read_text().splitlines()[0].count(",") >= 1 and not head.startswith(b"PAR1")
        else:
            assert head.startswith(MAGIC[form]), (form, head)
    for wrong in ("out.txt", "out.CSVX", "out"):
        code, _, err = _run([*argv, "-o", str(tmp_path / wrong)], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "this command writes ." in err and not (tmp_path / wrong).exists()


def test_a_csv_table_holds_list_cells_as_json(capture: Path, tmp_path: Path) -> None:
    """CSV has no list type: `stats -o x.csv` writes a list column's cells as JSON text, the
    same values as the Parquet table."""
    import json

    import polars as pl

    assert main(["stats", str(capture), "-o", str(tmp_path / "s.csv")]) == 0
    assert main(["stats", str(capture), "-o", str(tmp_path / "s.parquet")]) == 0
    table = pl.read_parquet(tmp_path / "s.parquet")
    listed = [name for name, dtype in table.schema.items() if isinstance(dtype, pl.List)]
    assert listed, "the statistics table has list columns"
    csv = pl.read_csv(tmp_path / "s.csv", infer_schema_length=0)
    assert csv.columns == table.columns and csv.height == table.height
    for name in listed:
        assert [json.loads(cell) for cell in csv[name].to_list()] == table[name].to_list()
