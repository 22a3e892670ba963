"""The CLI commands, and the spec's worked example reproduced byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat.layout import FOOTER_SIZE, Footer
from kvsnap.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_worked_example_is_byte_exact(tmp_path: Path) -> None:
    """spec/SPEC.md section 16 describes spec/vectors/example.kv; the writer reproduces it."""
    k = np.array([[[1.0, 2.0], [3.0, 4.0]]], np.float16)
    v = np.array([[[-1.0, 0.5], [0.25, -2.0]]], np.float16)
    path = tmp_path / "example.kv"
    kvformat.save(path, [kvformat.Layer(k, v)], metadata={"model": {"name": "tiny"}})
    data = path.read_bytes()
    assert data == (ROOT / "spec" / "vectors" / "example.kv").read_bytes()
    assert len(data) == 1333
    footer = Footer.unpack(data[-FOOTER_SIZE:])
    assert (footer.index_offset, footer.chunk_count, footer.json_size) == (0x340, 2, 309)
    assert data[0x1C0:0x1C8] == k.tobytes() and data[0x240:0x248] == v.tobytes()
    record = b'{"parent":null,"drop":[],"append":[],"metadata":{},"append_chunks":[0,2]}'
    assert data[0x2C0 : 0x2C0 + len(record)] == record
    spec = (ROOT / "spec" / "SPEC.md").read_text()
    assert record.decode() in spec and "footer_crc" in spec
    assert "header_crc = 0x51bdafe0" in spec and f"{int.from_bytes(data[60:64], 'little'):#x}" == "0x51bdafe0"
    assert f"{int.from_bytes(data[-4:], 'little'):08x}" == "6716c920"  # footer_crc as SPEC shows it


def test_info_verify_dump_pack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(3)
    npz = tmp_path / "in.npz"
    arrays = {
        "k_L0": rng.standard_normal((2, 7, 4)).astype(np.float32),
        "v_L0": rng.standard_normal((2, 7, 4)).astype(np.float32),
        "k_L2": rng.standard_normal((1, 3, 8)).astype(np.float16),
        "v_L2": rng.standard_normal((1, 3, 6)).astype(np.float16),
    }
    np.savez(npz, **arrays)
    out = tmp_path / "out.kv"
    assert main(["pack", str(npz), str(out), "--codec", "zstd", "--chunk-tokens", "2"]) == 0
    assert str(out) in capsys.readouterr().out
    with kvformat.open(out) as snap:  # the flags took effect: zstd chunks of at most 2 tokens
        table = snap._file.table
        assert set(table["codec"].tolist()) == {kvformat.Zstd().code}
        assert set(table["rows"].tolist()) == {1, 2}
        for layer in (0, 2):
            for head in range(arrays[f"k_L{layer}"].shape[0]):
                got = snap.head(layer, head)
                assert got is not None and got.k.dtype == arrays[f"k_L{layer}"].dtype
                assert np.array_equal(got.k, arrays[f"k_L{layer}"][head])
                assert np.array_equal(got.v, arrays[f"v_L{layer}"][head])
    assert main(["info", str(out), "--json"]) == 0
    description = json.loads(capsys.readouterr().out)
    assert description["num_layers"] == 3
    assert [layer["present"] for layer in description["layers"]] == [True, False, True]
    assert description["layers"][2]["v_dim"] == 6
    assert main(["info", str(out)]) == 0
    assert "absent" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 0
    assert "OK" in capsys.readouterr().out
    dumped = tmp_path / "head.npz"
    assert main(["dump", str(out), "--layer", "0", "--head", "1", "-o", str(dumped)]) == 0
    with np.load(dumped) as got:
        assert np.array_equal(got["k"], arrays["k_L0"][1])
        assert got["positions"].tolist() == list(range(7))


def test_errors_are_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"not a kv file at all" * 10)
    assert main(["verify", str(bad)]) == 2
    assert "CorruptFileError" in capsys.readouterr().err
    assert main(["info", str(tmp_path / "missing.kv")]) == 2
    err = capsys.readouterr().err
    assert "missing.kv" in err and "Traceback" not in err


def test_recover_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = kvformat.LayerSpec(1, 2, 2, kvformat.FLOAT32)
    writer = kvformat.Writer(tmp_path / "x.kv", [spec])
    # append_many writes at once (`append` would gather until the snapshot)
    writer.append_many([(0, np.ones((1, 3, 2), np.float32), np.ones((1, 3, 2), np.float32), None, 0)])
    writer._file.close()  # simulate a crash: the process dies before close() (its lock goes with it)
    partial = tmp_path / "x.kv.partial"
    assert partial.exists() and not (tmp_path / "x.kv").exists()
    assert main(["recover", str(partial)]) == 0
    assert "1 snapshot" in capsys.readouterr().out
    with kvformat.open(tmp_path / "x.kv") as snap:
        head = snap.head(0, 0)
        assert head is not None and head.positions.tolist() == [0, 1, 2]
        assert snap.snapshot_metadata == {"recovered": True}
    writer._file.close()
