"""The importer contract (`kvformat.importers.contract.Importer`) and its registry: a new foreign
format is one module in `kvformat.importers`, and with it ``kvsnap import`` converts the format,
a reader names that command for such a file, and the registry lists it. Shown here with a
format written for the test, placed beside the package's own modules."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat import errors, importers
from kvsnap.cli import main

TINY = """
import numpy as np

import kvformat
from kvformat.importers.contract import Imported, Importer


class TinyImporter(Importer):
    name = "tiny"
    description = "tiny test format"
    magics = (b"TINYKV01",)

    def convert(self, source, output, *, codec="raw", overwrite=False, **options):
        with open(source, "rb") as f:
            rows = np.frombuffer(f.read()[8:], np.float32).reshape(1, -1, 4)
        kvformat.save(output, [kvformat.Layer(rows, rows)], codec=codec, overwrite=overwrite)
        return Imported(str(output), f"{rows.shape[1]} positions")


IMPORTER = TinyImporter()
"""


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The module above as one more file of `kvformat.importers`, and a file of its format."""
    folder = tmp_path / "more"
    folder.mkdir()
    (folder / "tiny.py").write_text(TINY)
    monkeypatch.setattr(importers, "__path__", [*importers.__path__, str(folder)])
    monkeypatch.delitem(sys.modules, "kvformat.importers.tiny", raising=False)
    rows = np.arange(24, dtype=np.float32)
    source = tmp_path / "cache.tiny"
    source.write_bytes(b"TINYKV01" + rows.tobytes())
    return source


def test_a_format_in_one_file_is_listed_converted_and_named(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert set(importers.importers()) == {"mlxkv", "go-mlx-bundles", "tiny"}
    named = rf"tiny test format.*kvsnap import {re.escape(str(tiny))}"
    with pytest.raises(errors.ForeignFormatError, match=named):
        kvformat.open(tiny)
    out = tmp_path / "cache.kv"
    assert main(["import", str(tiny), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}: 6 positions"
    with kvformat.open(out) as snap:
        np.testing.assert_array_equal(snap.head(0, 0).k, np.arange(24, dtype=np.float32).reshape(6, 4))
    assert main(["import", str(tiny), "--list"]) == 2  # the contract's default: nothing to list
    assert "tiny test format holds nothing to list" in capsys.readouterr().err


def test_a_file_no_importer_knows_and_an_unknown_name_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.bin"
    other.write_bytes(b"NOTAKV00" * 4)
    with pytest.raises(errors.InvalidArgumentError, match=r"not a format kvsnap imports.*mlxkv"):
        importers.for_source(other)
    with pytest.raises(errors.UnknownNameError, match="no importer named 'nope'"):
        importers.for_source(other, "nope")
    assert main(["import", str(other), str(tmp_path / "x.kv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a format kvsnap imports" in err
    assert not (tmp_path / "x.kv").exists()


def test_registered_importers_join_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvformat.importers import registry

    class Other(importers.Importer):
        name = "other"
        description = "another format"
        magics = (b"OTHER",)

        def convert(self, source, output, *, codec="raw", overwrite=False, **options):  # type: ignore[no-untyped-def]
            raise AssertionError("not called")

    monkeypatch.setattr(registry, "_ADDED", {})
    importers.register(Other())
    assert importers.by_magic(b"OTHER and more").name == "other"  # type: ignore[union-attr]
    assert importers.by_magic(b"MLXKV001").name == "mlxkv"  # type: ignore[union-attr]
    assert importers.by_magic(b"\x89KVS\r\n\x1a\n") is None
