"""Conformance vectors: the generator reproduces the committed files bit for bit, our reader
passes every vector (in-process and through the `--reader CMD` contract), a wrong reader fails,
and a structure-aware fuzzer over the vectors finds only KVFormatError."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvformat
from kvsnap.cli import main
from kvsnap.cli.conformance import describe, run

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"
GOLD = VECTORS / "gold"
FUZZ = VECTORS / "fuzz"


def load_generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("generate_vectors", VECTORS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed_files() -> list[Path]:
    """The current version's vectors (the frozen copies under ``gold/`` are not regenerated)."""
    return sorted(
        p
        for p in VECTORS.rglob("*")
        if p.is_file() and p.suffix in (".kv", ".json") and not {GOLD, FUZZ} & set(p.parents)
    )


def test_generator_reproduces_the_committed_vectors(tmp_path: Path) -> None:
    load_generator().generate(tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    committed = [p.relative_to(VECTORS) for p in committed_files() if p.name != "example.kv"]
    assert fresh == committed
    for relative in fresh:
        assert (tmp_path / relative).read_bytes() == (VECTORS / relative).read_bytes(), relative


def test_vectors_are_small_and_cover_the_features() -> None:
    assert sum(p.stat().st_size for p in committed_files()) < 10_000_000
    manifest = json.loads((VECTORS / "manifest.json").read_text("utf-8"))
    listed = {entry["file"] for entry in manifest["vectors"]}
    on_disk = {  # example.kv is SPEC section 16's worked example, not a vector
        p.relative_to(VECTORS).as_posix()
        for p in committed_files()
        if p.suffix == ".kv" and p.name != "example.kv"
    }
    assert listed == on_disk  # every vector file is in the manifest, and only those
    results = run(VECTORS)
    assert len(results) == len(manifest["vectors"]) == 95
    assert all(r.passed for r in results), [r for r in results if not r.passed]
    expectations = [entry["expect"] for entry in manifest["vectors"]]
    assert sum("error" in e for e in expectations) == 67  # hostile vectors, each with its error class


def test_series_as_triples_and_as_ranges_describe_alike() -> None:
    """series-1.1.kv is series.kv stored as 1.1 stored it (SPEC 14): same heads, same bytes."""
    ranges, triples = describe(VECTORS / "series.kv"), describe(VECTORS / "series-1.1.kv")
    assert ranges.pop("version") == [1, 2] and triples.pop("version") == [1, 1]
    assert ranges == triples


def test_reader_command_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reader = f"{sys.executable} -m kvsnap.cli describe"
    assert main(["conformance", str(VECTORS), "--reader", reader, "--batch"]) == 0  # one process
    assert capsys.readouterr().out.splitlines()[-1].startswith("95/95 passed")
    few = _few_vectors(
        tmp_path / "few", ["float32-raw.kv", "series.kv", "bad/truncated-footer.kv", "bad/zero-heads.kv"]
    )
    assert main(["conformance", str(few), "--reader", reader]) == 0  # a process per vector
    assert capsys.readouterr().out.splitlines()[-1].startswith("4/4 passed")
    # A batch that stops short: the vectors without their line fail, the others pass.
    short = tmp_path / "short.py"
    short.write_text(
        "import subprocess, sys\n"
        f"subprocess.run([{sys.executable!r}, '-m', 'kvsnap.cli', 'describe', *sys.argv[1:3]])\n"
    )
    results = run(few, f"{sys.executable} {short}", batch=True)
    assert [r.passed for r in results] == [True, True, False, False]
    assert "line 3 of the batch" in results[2].detail
    # Wrong readers against a few vectors, good and bad.
    liar = tmp_path / "liar.py"
    liar.write_text("print('{\"version\": [1, 0]}')\n")
    assert main(["conformance", str(few), "--reader", f"{sys.executable} {liar}"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "/4 passed" in out
    # A reader that crashes or refuses everything with a made-up error passes nothing.
    for name, source in (
        ("crash.py", "raise SystemExit(1)\n"),
        ("refuser.py", 'print(\'{"error": "IOError"}\')\n'),
    ):
        (tmp_path / name).write_text(source)
        assert main(["conformance", str(few), "--reader", f"{sys.executable} {tmp_path / name}"]) == 1
        assert capsys.readouterr().out.splitlines()[-1].startswith("0/4 passed"), name
    results = run(few, "false")
    assert not any(r.passed for r in results) and "no JSON object" in results[0].detail


def _few_vectors(folder: Path, names: list[str]) -> Path:
    """A copy of the vectors ``names`` with a manifest of just those."""
    import shutil

    manifest = json.loads((VECTORS / "manifest.json").read_text())
    manifest["vectors"] = [v for v in manifest["vectors"] if v["file"] in names]
    assert len(manifest["vectors"]) == len(names)
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(VECTORS / name, folder / name)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_wrong_hash_is_detected(tmp_path: Path) -> None:
    import json
    import shutil

    shutil.copytree(VECTORS, tmp_path / "v")
    manifest = json.loads((tmp_path / "v" / "manifest.json").read_text())
    manifest["vectors"][0]["expect"]["snapshots"][0]["heads"][0]["k"] = "0" * 64
    (tmp_path / "v" / "manifest.json").write_text(json.dumps(manifest))
    failed = [r for r in run(tmp_path / "v") if not r.passed]
    assert [r.name for r in failed] == ["float32-raw.kv"]
    assert "heads[0].k" in failed[0].detail


GOOD = [p for p in sorted(VECTORS.glob("*.kv"))]


FUZZ_EXAMPLES = int(os.environ.get("KVSNAP_FUZZ_EXAMPLES", "150"))  # raise it for a long fuzz run


@settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    index=st.integers(0, len(GOOD) - 1),
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.floats(0, 1)),
)
def test_fuzz_vectors_raise_only_format_errors(
    tmp_path: Path, index: int, edits: list, cut: float | None
) -> None:
    """Structure-aware: start from a valid vector, overwrite bytes (anywhere: header,
    descriptors, payloads, table, JSON, footer) and maybe truncate; then open, read everything
    and verify. Only KVFormatError may come out, within 10 seconds."""
    data = bytearray(GOOD[index].read_bytes())
    for where, value in edits:
        data[int(where * len(data))] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    path = tmp_path / "fuzz.kv"
    path.write_bytes(bytes(data))

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError("reader hung")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    try:
        description = describe(path)  # opens every snapshot, reads every head, verifies
        if "error" not in description:
            with kvformat.open(path) as snap:
                for head in snap.heads():
                    assert np.asarray(head.k).shape[0] == head.positions.size
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_descriptions_hash_one_nan_per_dtype() -> None:
    """SPEC 17: NaNs of dequantized rows hash as the canonical quiet NaN of their dtype, whatever
    payload the arithmetic produced."""
    import ml_dtypes

    from kvsnap.cli.conformance import _canonical_nans

    for dtype, bits_type, canonical, other in (
        (np.float16, np.uint16, 0x7E00, 0x7E01),
        (ml_dtypes.bfloat16, np.uint16, 0x7FC0, 0xFFC1),
        (np.float32, np.uint32, 0x7FC00000, 0xFFC00001),
    ):
        values = np.array([1.5, 0, 0, -2], dtype=dtype)
        values.view(bits_type)[1:3] = other
        fixed = _canonical_nans(values)
        assert fixed.view(bits_type)[1:3].tolist() == [canonical, canonical], dtype
        np.testing.assert_array_equal(fixed.astype(np.float32)[[0, 3]], [1.5, -2])
        assert _canonical_nans(values[[0, 3]]) is not None


def test_head_sequence_limit_is_enforced_by_writer(tmp_path: Path) -> None:
    import kvformat

    spec = kvformat.LayerSpec(65536, 1, 1, kvformat.dtypes.from_numpy(np.dtype(np.float32)))
    with pytest.raises(ValueError, match=r"triples declared; the limit is 16777216 \(2\^24\)"):
        kvformat.Writer(tmp_path / "big.kv", [spec] * 300)


GOLD_VERSIONS = sorted(p.name for p in GOLD.iterdir() if p.is_dir())


@pytest.mark.parametrize("version", GOLD_VERSIONS)
def test_gold_files_of_every_released_version_still_read_as_they_did(version: str) -> None:
    """Each released version's vectors, byte for byte as released: every golden file gives the
    description it gave then, every hostile one the same error category."""
    manifest = json.loads((GOLD / version / "manifest.json").read_text("utf-8"))
    results = run(GOLD / version)
    assert len(results) == len(manifest["vectors"]) > 20
    assert all(r.passed for r in results), [r for r in results if not r.passed]


def test_the_fuzz_corpus_replays() -> None:
    """Every input a fuzzer found (spec/vectors/fuzz/, each listed with what it must produce)
    still gives it; tests/spec/test_js_reader.py replays them with the JavaScript reader."""
    manifest = json.loads((FUZZ / "manifest.json").read_text("utf-8"))
    assert sorted(e["file"] for e in manifest["vectors"]) == sorted(p.name for p in FUZZ.glob("*.kv"))
    results = run(FUZZ)
    assert len(results) == len(manifest["vectors"]) >= 3
    assert all(r.passed for r in results), [r for r in results if not r.passed]


def test_gold_files_are_never_rewritten() -> None:
    """Every gold file matches the SHA-256 recorded when it was frozen, none is missing, none added
    without a line; the current minor version has its folder."""
    sums = {}
    for line in (GOLD / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.removeprefix("./")] = digest
    on_disk = {
        p.relative_to(GOLD).as_posix(): p
        for p in GOLD.rglob("*")
        if p.is_file() and p.name not in ("SHA256SUMS", "README.md")
    }
    assert sorted(on_disk) == sorted(sums)
    for name, path in on_disk.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sums[name], f"gold file {name} was rewritten"
    assert GOLD_VERSIONS == ["1.0", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7", "1.8"]
    assert f"{kvformat.FORMAT_VERSION[0]}.{kvformat.FORMAT_VERSION[1]}" in GOLD_VERSIONS
