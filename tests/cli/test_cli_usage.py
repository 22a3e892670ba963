"""Everyday command-line use: snapshot numbering, out-of-range selections, numeric
flags checked when parsed, pack of float64 arrays, similarity naming files. Each bad input is
one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvsnap.cli import main


@pytest.fixture
def series(tmp_path: Path) -> Path:
    spec = kvformat.LayerSpec(2, 4, 4, kvformat.dtypes.from_numpy(np.dtype(np.float32)))
    path = tmp_path / "series.kv"
    with kvformat.Writer(path, [spec, spec]) as writer:
        for step in range(3):
            k = np.full((2, 2, 4), step, np.float32)
            writer.append(0, k, k)
            writer.append(1, k, k)
            writer.snapshot()
    return path


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    assert err and message in err[-1], (argv, err)
    assert "Traceback" not in "\n".join(err)


def test_a_ray_address_without_the_ray_engine_is_refused(
    series: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stats --address` used to be ignored silently without `--engine ray`."""
    one_line_error(capsys, ["stats", str(series), "--address", "ray://head:10001"], "add --engine ray")


def test_snapshots_are_numbered_from_0_as_typed(series: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(series), "--snapshot", "0"]) == 0
    assert "snapshot 0 of 3 (numbered 0..2)" in capsys.readouterr().out
    assert main(["info", str(series)]) == 0
    assert "snapshot 2 of 3" in capsys.readouterr().out
    assert main(["info", str(series), "--snapshot", "-3"]) == 0
    assert "snapshot 0 of 3" in capsys.readouterr().out
    with kvformat.open(series, 1) as snap:
        assert "snapshot 1 of 0..2" in repr(snap)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["info", "{f}", "--snapshot", "3"],
            "snapshot 3 out of range: the file holds 3 (numbered 0..2; -1 is the last)",
        ),
        (["info", "{f}", "--snapshot", "-4"], "snapshot -4 out of range"),
        (["dump", "{f}", "--layer", "2", "--head", "0", "-o", "x.npz"], "layer 2 out of range 0..1"),
        (
            ["dump", "{f}", "--layer", "0", "--head", "2", "-o", "x.npz"],
            "head 2 out of range 0..1 in layer 0",
        ),
        (
            ["dump", "{f}", "--layer", "0", "--head", "0", "--seq", "1", "-o", "x.npz"],
            "seq 1 out of range 0..0",
        ),
        (
            ["dump", "{f}", "--layer", "-1", "--head", "0", "-o", "x.npz"],
            "--layer: must be 0 or more, got -1",
        ),
        (
            ["dump", "{f}", "--snapshot", "7", "--layer", "0", "--head", "0", "-o", "x.npz"],
            "snapshot 7 out of range",
        ),
    ],
)
def test_out_of_range_selections_are_one_line(
    series: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    one_line_error(capsys, [a.replace("{f}", str(series)) for a in argv], message)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["stats", "{f}", "--jobs", "-2"], "--jobs: must be at least 1, got -2"),
        (["stats", "{f}", "--factor", "0"], "--factor: must be a number above 0, got 0"),
        (["outliers", "{f}", "--threshold", "-1"], "--threshold: must be a number above 0, got -1"),
        (["similarity", "{f}", "--top", "-1"], "--top: must be at least 1, got -1"),
        (["stats", "{f}", "--factor", "nan"], "--factor: must be a number above 0, got nan"),
        (["pack", "in.npz", "out.kv", "--chunk-tokens", "0"], "--chunk-tokens: must be at least 1, got 0"),
        (
            ["capture", "model", "--prompt", "x", "-o", "o.kv", "--temp", "-1"],
            "--temp: must be 0 or more, got -1",
        ),
        (
            ["capture", "model", "--prompt", "x", "-o", "o.kv", "--top-p", "1.5"],
            "--top-p: must be in 0..1, got 1.5",
        ),
    ],
)
def test_numeric_flags_are_checked_when_parsed(
    series: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    one_line_error(capsys, [a.replace("{f}", str(series)) for a in argv], message)


def test_pack_of_float64_arrays_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    k = np.random.default_rng(0).standard_normal((2, 5, 4))  # float64, numpy's default
    np.savez(tmp_path / "in.npz", k_L0=k, v_L0=k)
    assert main(["pack", str(tmp_path / "in.npz"), str(tmp_path / "out.kv")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "k_L0 is float64, which .kv does not store: pass --dtype" in line
    assert main(["pack", str(tmp_path / "in.npz"), str(tmp_path / "out.kv"), "--dtype", "float32"]) == 0
    with kvformat.open(tmp_path / "out.kv") as snap:
        head = snap.head(0, 1)
        assert head is not None
        np.testing.assert_array_equal(head.k, k[1].astype(np.float32))


def test_similarity_names_the_file_of_each_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    paths = []
    for i in range(2):
        k = rng.standard_normal((3, 20, 8)).astype(np.float32)
        paths.append(str(tmp_path / f"s{i}.kv"))
        kvformat.save(paths[-1], [kvformat.Layer(k, k), kvformat.Layer(k * 2, k)])
    assert main(["similarity", *paths, "--top", "2", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{paths[0]}: layer" in out and f"{paths[1]}: layer" in out


def test_info_shows_text_settings_quantization_and_groups_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    k = np.ones((2, 3, 4), np.float16)
    layers = [kvformat.Layer(k, k)] * 5 + [kvformat.Layer(k[:, :2], k[:, :2])]
    metadata = {
        "prompt": "Why is the sky blue? " * 20,
        "generated_text": "Rayleigh scattering.",
        "generation": {"temperature": 0.0, "max_tokens": 48, "seed": None},
    }
    kvformat.save(tmp_path / "i.kv", layers, metadata=metadata)
    assert main(["info", str(tmp_path / "i.kv")]) == 0
    out = capsys.readouterr().out
    assert "layers 0-4: 2 heads, k_dim 4, v_dim 4, float16, 3 tokens (positions 0..2)" in out
    assert "layer   5: 2 heads" in out and "2 tokens" in out
    assert "generation: temperature 0.0, max_tokens 48\n" in out
    prompt_line = next(line for line in out.splitlines() if line.startswith("  prompt: "))
    assert len(prompt_line) <= 112 and " ... " in prompt_line
    assert "generated: Rayleigh scattering." in out
    vectors = Path(__file__).resolve().parents[2] / "spec" / "vectors"
    assert main(["info", str(vectors / "quantized.kv")]) == 0
    assert "4-bit affine quantized (groups of 32, float16 scales)" in capsys.readouterr().out
    assert main(["info", str(vectors / "queries-sparse.kv")]) == 0  # 1.7: rows at positions 4..8
    assert "queries: 2 heads, 9 positions (0..8); sparse: 5 of them read 3 keys" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["csv", "npy", "npz", "parquet"])
def test_export_writes_one_file_per_head(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow.csv as csv
    import pyarrow.parquet as parquet

    rng = np.random.default_rng(4)
    k = rng.standard_normal((3, 6, 4)).astype(np.float16)
    v = rng.standard_normal((3, 6, 2)).astype(np.float16)
    positions = np.array([0, 1, 2, 10, 11, 12])
    kvformat.save(tmp_path / "e.kv", [kvformat.Layer(k, v, positions), None, kvformat.Layer(k, v, positions)])
    out = tmp_path / "heads"
    assert main(["export", str(tmp_path / "e.kv"), "-o", str(out), "--format", fmt, "--head", "2"]) == 0
    assert "wrote 2 " in capsys.readouterr().out
    if fmt == "npy":
        assert sorted(p.name for p in out.iterdir())[:3] == [
            "L00-H02.k.npy",
            "L00-H02.positions.npy",
            "L00-H02.v.npy",
        ]
        np.testing.assert_array_equal(np.load(out / "L02-H02.k.npy"), k[2].astype(np.float32))
        return
    name = out / f"L02-H02.{fmt}"
    assert sorted(p.name for p in out.iterdir()) == [f"L00-H02.{fmt}", f"L02-H02.{fmt}"]
    if fmt == "npz":
        with np.load(name) as data:
            np.testing.assert_array_equal(data["v"], v[2].astype(np.float32))
            np.testing.assert_array_equal(data["positions"], positions)
        return
    table = csv.read_csv(name) if fmt == "csv" else parquet.read_table(name)
    assert table.column_names == ["seq", "position", "k_0", "k_1", "k_2", "k_3", "v_0", "v_1"]
    assert table["position"].to_pylist() == positions.tolist()
    np.testing.assert_allclose(table["k_3"].to_numpy(), k[2, :, 3].astype(np.float32), rtol=1e-6)


def test_export_refuses_layers_outside_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    k = np.ones((1, 2, 4), np.float32)
    kvformat.save(tmp_path / "e.kv", [kvformat.Layer(k, k)])
    one_line_error(
        capsys,
        ["export", str(tmp_path / "e.kv"), "-o", str(tmp_path / "x"), "--layer", "3"],
        "layer 3 out of range 0..0",
    )


def test_lone_surrogates_are_refused_by_writer_and_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SPEC section 2: no unpaired surrogate in JSON strings. The writer refuses to write one;
    verify, describe and info agree on refusing a file that holds one (a conformance vector)."""
    k = np.ones((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match="metadata must be plain JSON"):
        kvformat.save(tmp_path / "s.kv", [kvformat.Layer(k, k)], metadata={"note": "\ud800"})
    kvformat.save(tmp_path / "ok.kv", [kvformat.Layer(k, k)], metadata={"note": "\U0001f600 paired"})
    with kvformat.open(tmp_path / "ok.kv") as snap:
        assert snap.metadata["note"] == "\U0001f600 paired"
    bad = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "bad" / "lone-surrogate-metadata.kv"
    for command in ("verify", "info"):
        assert main([command, str(bad)]) == 2
        assert "unpaired UTF-16 surrogate" in capsys.readouterr().err
    assert main(["describe", str(bad)]) == 0
    assert capsys.readouterr().out.strip() == '{"error": "CorruptFileError"}'


def test_plot_bins_long_sequences_into_readable_curves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """2000 positions x 3 layers are drawn as at most 256 points per layer (means
    of equal bins), and the panel says so; a short file keeps one point per position."""
    import numpy as np

    import kvformat

    rng = np.random.default_rng(0)
    layers = [kvformat.Layer(*(rng.standard_normal((2, 2000, 8), np.float32),) * 2) for _ in range(3)]
    kvformat.save(tmp_path / "long.kv", layers)
    assert (
        main(["plot", str(tmp_path / "long.kv"), "--stat", "norm_mean", "-o", str(tmp_path / "a.png")]) == 0
    )
    out = capsys.readouterr().out
    points = int(out.split(" heads, ")[1].split(" position points")[0])
    assert 3 * 200 <= points <= 3 * 256
    short = [kvformat.Layer(*(rng.standard_normal((2, 40, 8), np.float32),) * 2) for _ in range(3)]
    kvformat.save(tmp_path / "short.kv", short)
    assert (
        main(["plot", str(tmp_path / "short.kv"), "--stat", "norm_mean", "-o", str(tmp_path / "b.png")]) == 0
    )
    assert "3 layers x 2 heads, 120 position points" in capsys.readouterr().out


def test_stats_says_when_layers_hold_different_token_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file whose layers hold 28 and 20 tokens (uneven after a crash) is
    reported as such, not as "28 tokens"."""
    rng = np.random.default_rng(0)
    layers = [kvformat.Layer(*(rng.standard_normal((2, n, 8), np.float32),) * 2) for n in (28, 20)]
    kvformat.save(tmp_path / "uneven.kv", layers)
    assert main(["stats", str(tmp_path / "uneven.kv")]) == 0
    assert "(28 tokens; uneven: heads hold 20 to 28;" in capsys.readouterr().out
    kvformat.save(tmp_path / "even.kv", layers[:1])
    assert main(["stats", str(tmp_path / "even.kv")]) == 0
    assert "(28 tokens; * = above" in capsys.readouterr().out


def test_stage_commands_are_found_without_installed_metadata(
    series: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``kvsnap.commands`` entry points (kvsnap on ``sys.path``, not installed): the stages'
    commands are still there when their modules import."""
    from importlib import metadata

    real = metadata.entry_points

    def without_ours(**selection: Any) -> Any:
        found = real(**selection)
        return [] if selection.get("group") == "kvsnap.commands" else found

    monkeypatch.setattr(metadata, "entry_points", without_ours)
    assert main(["stats", str(series), "--stats", "norms"]) == 0
    assert "mean ||K|| per layer and KV head" in capsys.readouterr().out


def test_installed_stages_are_scanned_only_for_a_command_the_built_in_ones_lack(
    series: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command of the format or of the built-in stages parses without reading the installed
    packages' entry points (`kvsnap.cli.main`: ~30 ms of a fresh command where many packages
    are installed); any other command (or none: help) brings in the stages other packages
    declare as ``kvsnap.commands`` entry points."""
    import types
    from importlib import metadata

    plugin = types.ModuleType("kvsnap_test_plugin")

    def register(sub: Any) -> None:
        command = sub.add_parser("hello", help="a plugin's command")
        command.set_defaults(func=lambda args: print("hello from a plugin") or 0)

    plugin.register = register  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvsnap_test_plugin", plugin)
    scans: list[str] = []
    real = metadata.entry_points

    def entry_points(**selection: Any) -> Any:
        if selection.get("group") == "kvsnap.commands":
            scans.append("scan")
            ours = list(real(**selection))
            return [*ours, metadata.EntryPoint("plugin", "kvsnap_test_plugin:register", "kvsnap.commands")]
        return real(**selection)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    assert main(["info", str(series)]) == 0
    assert main(["stats", str(series), "--stats", "norms"]) == 0
    assert not scans
    assert main(["hello"]) == 0
    assert "hello from a plugin" in capsys.readouterr().out
    assert scans == ["scan"]


UNUSED_BY_A_SMALL_STATS = (
    "importlib.metadata",  # the stages' commands, crc32c's version
    "tqdm",  # a progress bar nobody sees
    "multiprocessing",  # the worker pool of a file too small for one
    "concurrent.futures.process",
    "secrets",  # an output's temporary name
    "statistics",  # the printed median
    "subprocess",  # fetch-models' download
    "zipfile",
    "hashlib",  # a GGUF's checksum
)


def test_a_fresh_stats_command_imports_no_package_metadata(series: Path, tmp_path: Path) -> None:
    """A fresh ``kvsnap stats FILE -o out.parquet`` of a small file (its output piped, as in a
    script) reads no installed package's metadata: not for the stages' commands, not for
    crc32c's version (`kvformat.checksum` loads its compiled module alone), not for a progress
    bar nobody sees (`analysis.engine.progress`); nor does it import what only other commands or a pass
    on worker processes use (`UNUSED_BY_A_SMALL_STATS`)."""
    code = (
        "import sys; from kvsnap.cli.launch import main; code = main(sys.argv[1:]);"
        f"print('imported:', sorted(m for m in {UNUSED_BY_A_SMALL_STATS!r} if m in sys.modules))"
    )
    out = tmp_path / "out.parquet"
    command = [sys.executable, "-c", code, "stats", str(series), "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "imported: []" in done.stdout and out.exists()


def test_a_source_tree_without_an_install_says_how_to_install(series: Path) -> None:
    """From a checkout on ``sys.path`` with the dependencies but no kvsnap install (no editable
    finder: ``python -S``), a stage command gets one line naming the install command, exit 2;
    format commands still run."""
    import site
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = "import sys; from kvsnap.cli import main; raise SystemExit(main(sys.argv[1:]))"
    env = {"PYTHONPATH": os.pathsep.join(site.getsitepackages()), "PATH": os.environ.get("PATH", "")}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-S", "-c", code, *argv]
        return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)

    missing = run("stats", str(series))
    assert missing.returncode == 2, missing.stderr
    (line,) = missing.stderr.strip().splitlines()
    assert "'stats' is not a format command" in line and "pip install -e" in line
    assert run("info", str(series)).returncode == 0


def test_a_missing_extra_is_one_line(
    series: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command whose optional dependency is not installed says which one and how to install
    it, exit 2 (no traceback)."""
    monkeypatch.setitem(sys.modules, "polars", None)
    assert main(["outliers", str(series)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kvsnap: error: outliers needs polars") and "pip install" in line
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    assert main(["stats", str(series)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kvsnap: error: stats needs pyarrow") and "pip install" in line


def test_stats_prints_and_saves_without_polars(
    series: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvsnap stats FILE -o out.parquet`` neither needs nor imports polars (its import is a
    third of a fresh command's time on a 16-core machine): the same printout and the same
    Parquet rows as `head_stats` gives."""
    import polars as pl

    from kvsnap.analysis import head_stats

    expected = head_stats(str(series))
    monkeypatch.setitem(sys.modules, "polars", None)
    assert main(["stats", str(series), "-o", str(tmp_path / "out.parquet")]) == 0
    printed = capsys.readouterr().out
    monkeypatch.delitem(sys.modules, "polars")
    assert pl.read_parquet(tmp_path / "out.parquet").equals(expected)
    keys = expected.filter(pl.col("tensor") == "k")
    median = keys["norm_mean"].median()
    assert isinstance(median, float)
    top = keys.sort("norm_mean", descending=True).row(0, named=True)
    ratio = top["norm_mean"] / median
    assert f"largest: layer {top['layer']} head {top['head']} ({ratio:.2f}x median)" in printed
    # A fresh process, as a user runs it: neither polars nor pandas (which pyarrow.compute would
    # import) is loaded.
    script = (
        "import sys; from kvsnap.cli import main; "
        f"main(['stats', {str(series)!r}, '-o', {str(tmp_path / 'again.parquet')!r}]); "
        "print(sorted(m for m in ('polars', 'pandas') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_each_stage_command_reads_typed_options_its_parser_declares() -> None:
    """Every command builds its options dataclass (an analysis command ``X_command``:
    ``XOptions``) from the parsed arguments; each field is an argument its parser declares (a
    misspelt field would silently keep its default)."""
    import dataclasses
    import importlib

    from kvsnap.analysis.cli import COMMANDS
    from kvsnap.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for function, module_name in COMMANDS.items():
        command = function.removesuffix("_command")
        module = importlib.import_module(f"kvsnap.analysis.commands.{module_name}")
        options = getattr(module, f"{command.capitalize()}Options")
        declared = {action.dest for action in commands[command]._actions}
        fields = {field.name for field in dataclasses.fields(options)}
        assert fields <= declared, (command, sorted(fields - declared))
    from kvsnap.capture import cli as capture_cli
    from kvsnap.cli import format_commands

    for command, options in (
        ("capture", capture_cli.CaptureOptions),
        ("convert-gguf", capture_cli.ConvertOptions),
        ("fetch-models", capture_cli.FetchOptions),
        ("info", format_commands.InfoOptions),
        ("verify", format_commands.FileOptions),
        ("recover", format_commands.RecoverOptions),
        ("pack", format_commands.PackOptions),
        ("import-mlxkv", format_commands.ImportOptions),
        ("describe", format_commands.DescribeOptions),
        ("conformance", format_commands.ConformanceOptions),
        ("dump", format_commands.DumpOptions),
    ):
        declared = {action.dest for action in commands[command]._actions}
        assert {field.name for field in dataclasses.fields(options)} <= declared, command
