"""go-mlx MLXKV001 import: every layout version, tag, dtype, slab form and sliding
window reads back exactly as this repository's own MLXKV001 writer (tests/mlxkv/generate.py)
wrote it; hostile files give one clear error, allocate nothing large and leave nothing at DST."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat import errors
from kvformat.importers.mlxkv import import_mlxkv
from kvsnap.cli import main
from tests.mlxkv import generate

HERE = Path(__file__).resolve().parents[1] / "mlxkv"


GEN = generate
EXPECTED = json.loads((HERE / "expected.json").read_text())


def test_generator_reproduces_the_committed_files(tmp_path: Path) -> None:
    fresh = GEN.generate(tmp_path)
    assert fresh == EXPECTED
    for path in sorted(tmp_path.rglob("*.mlxkv")):
        assert path.read_bytes() == (HERE / path.relative_to(tmp_path)).read_bytes(), path.name


def expected_heads(snapshot: object) -> dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(layer, seq, head) -> K, V, positions as a reader must return them, in the dtype the
    layer must have (the tensors' own, or float32 when a layer mixes them)."""
    out = {}
    seq_len = snapshot.seq_len  # type: ignore[attr-defined]
    for layer in snapshot.layers:  # type: ignore[attr-defined]
        enc = layer.encodings
        heads: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        if layer.slab_k is not None:
            k = GEN.decoded(layer.slab_k, enc[0])
            v = GEN.decoded(layer.slab_v, enc[0])
            if k.ndim == 3:  # [L, H, D] -> [1, H, L, D]
                k, v = k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]
            for seq in range(k.shape[0]):
                for head in range(k.shape[1]):
                    rows = k.shape[2]
                    heads[(layer.index, seq, head)] = (
                        k[seq, head],
                        v[seq, head],
                        np.arange(seq_len - rows, seq_len),
                    )
        else:
            for head, (k, v) in enumerate(layer.heads):
                if snapshot.version >= 3:  # type: ignore[attr-defined]
                    k = GEN.decoded(k, enc[(2 * head) % len(enc)])
                    v = GEN.decoded(v, enc[(2 * head + 1) % len(enc)])
                heads[(layer.index, 0, head)] = (k, v, np.arange(seq_len - k.shape[0], seq_len))
        kinds = {a.dtype for k, v, _ in heads.values() for a in (k, v)}
        wide = len(kinds) > 1
        for key, (k, v, positions) in heads.items():
            out[key] = (k.astype(np.float32), v.astype(np.float32), positions) if wide else (k, v, positions)
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED["golden"]))
def test_golden_files_import_exactly(tmp_path: Path, name: str) -> None:
    source = GEN.golden()[name]
    out = tmp_path / "out.kv"
    report = import_mlxkv(HERE / name, out)
    assert report.sha256 == hashlib.sha256((HERE / name).read_bytes()).hexdigest()
    expected = expected_heads(source)
    with kvformat.open(out) as snap:
        snap.verify()
        assert snap.num_layers == source.num_layers
        present = {i for i, spec in enumerate(snap.layers) if spec.present}
        assert present == {layer.index for layer in source.layers}
        for (layer, seq, head), (k, v, positions) in expected.items():
            got = snap.head(layer, head, seq)
            assert got is not None
            assert got.k.dtype == k.dtype and got.v.dtype == v.dtype
            np.testing.assert_array_equal(got.k, k)
            np.testing.assert_array_equal(got.v, v)
            np.testing.assert_array_equal(got.positions, positions)
        meta = snap.metadata
        assert meta["model"]["architecture"] == source.architecture
        assert meta["source"] == {
            "format": "go-mlx MLXKV001",
            "version": source.version,
            "file": name,
            "bytes": (HERE / name).stat().st_size,
            "seq_len": source.seq_len,
            "token_offset": source.token_offset,
            "sha256": report.sha256,
        }
        shot = snap.snapshot_metadata
        if snap.num_seqs == 1:
            assert shot["tokens"] == [source.tokens] and shot["generated_ids"] == [source.generated]
        assert shot["generated"] == len(source.generated)
        logits = snap.array("last_logits")
        if source.logits is None or not source.logits.size:
            assert logits is None
        else:
            assert logits is not None and logits.shape[-1] == source.logit_shape[-1]
            np.testing.assert_array_equal(logits.reshape(-1), source.logits)
            assert shot["last_logits_shape"] == source.logit_shape


def test_dtypes_kept_and_mixed_layers_widened(tmp_path: Path) -> None:
    import_mlxkv(HERE / "native-dtypes.mlxkv", tmp_path / "n.kv")
    with kvformat.open(tmp_path / "n.kv") as snap:
        names = [spec.dtype.name for spec in snap.layers]  # type: ignore[union-attr]
        assert names == ["float32", "float32", "float16", "float16", "bfloat16", "bfloat16"]
        assert snap.layers[1].attributes["source_encoding"] == ["native:float32"]
    import_mlxkv(HERE / "mixed-tags.mlxkv", tmp_path / "m.kv")
    with kvformat.open(tmp_path / "m.kv") as snap:
        spec = snap.layers[0]
        assert spec.dtype is not None and spec.dtype.name == "float32"
        assert spec.attributes["source_encoding"] == ["float32", "native:float16", "q8"]
        head = snap.head(0, 0)
        assert head is not None and np.isnan(head.k[2, 1])  # the NaN tensor fell back to float32


def test_sliding_windows_and_slabs(tmp_path: Path) -> None:
    import_mlxkv(HERE / "slabs.mlxkv", tmp_path / "s.kv")
    with kvformat.open(tmp_path / "s.kv") as snap:
        assert snap.num_seqs == 2 and snap.layers[0].num_heads == 3
        window = snap.layers[1]
        assert window.attributes["kind"] == "sliding" and window.attributes["window"] == 4
        positions = snap.positions(1, 2, 0)
        assert positions is not None and positions.tolist() == [3, 4, 5, 6]
        assert "tokens" not in snap.snapshot_metadata  # one token list cannot name two sequences


def test_memory_is_bounded_by_one_layer(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    layers = [GEN.Layer(i, [GEN._kv(rng, 2048, 64) for _ in range(4)]) for i in range(8)]
    src = tmp_path / "big.mlxkv"
    src.write_bytes(GEN.Snapshot(3, "llama", 8, 4, 2048, 64, 8, [], layers).to_bytes())
    layer_bytes = 4 * 2 * 2048 * 64 * 4  # 4 heads of K and V, float32
    tracemalloc.start()
    try:
        import_mlxkv(src, tmp_path / "big.kv")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert src.stat().st_size > 7 * layer_bytes
    assert peak < 2 * layer_bytes, f"peak {peak} for a {src.stat().st_size}-byte source"


@pytest.mark.parametrize("name", sorted(EXPECTED["hostile"]))
def test_hostile_files_are_refused_cleanly(tmp_path: Path, name: str) -> None:
    out = tmp_path / "out.kv"
    tracemalloc.start()
    try:
        with pytest.raises(errors.KVFormatError) as info:
            import_mlxkv(HERE / "bad" / name, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert type(info.value).__name__ == EXPECTED["hostile"][name], str(info.value)
    assert "MLXKV001" in str(info.value)
    assert peak < 16 << 20  # no allocation sized by a hostile count
    assert not out.exists() and not Path(f"{out}.partial").exists()


def test_truncation_anywhere_is_refused(tmp_path: Path) -> None:
    data = (HERE / "v6.mlxkv").read_bytes()
    src, out = tmp_path / "cut.mlxkv", tmp_path / "out.kv"
    for cut in range(0, len(data), 3):
        src.write_bytes(data[:cut])
        with pytest.raises(errors.KVFormatError):
            import_mlxkv(src, out)
        assert not out.exists() and not Path(f"{out}.partial").exists(), cut


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "v6.kv"
    assert main(["import-mlxkv", str(HERE / "v6.mlxkv"), str(out), "--codec", "zstd"]) == 0
    printed = capsys.readouterr().out
    assert "MLXKV001 version 6" in printed and str(out) in printed
    with kvformat.open(out) as snap:
        assert snap._file.chunk(0).codec != 0  # zstd
    assert main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "model: (unnamed) (llama)" in info and "imported from: v6.mlxkv (go-mlx MLXKV001 version 6" in info
    assert main(["import-mlxkv", str(HERE / "v6.mlxkv"), str(out)]) == 2  # exists: refused
    assert "--force" in capsys.readouterr().err
    assert main(["import-mlxkv", str(HERE / "v6.mlxkv"), str(out), "--force"]) == 0
    capsys.readouterr()
    assert main(["import-mlxkv", str(HERE / "bad" / "huge-count.mlxkv"), str(tmp_path / "x.kv")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "TruncatedFileError" in err and "MLXKV001" in err


def test_opening_an_mlxkv_file_names_the_import_command(tmp_path: Path) -> None:
    with pytest.raises(errors.ForeignFormatError, match="kvsnap import "):
        kvformat.open(HERE / "v3.mlxkv")
    assert main(["info", str(HERE / "v3.mlxkv")]) == 2
