"""go-mlx block bundles: State logs, KVST containers and manifest files import to a
series whose snapshots hold exactly what tests/mlxkv/bundles.py (an independent writer of the
layout) gave each turn, blocks reused across turns stored once; hostile files give one clear
error, allocate nothing large and leave nothing at DST."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat import errors
from kvformat.importers.bundles import import_bundles, list_bundles
from kvsnap.cli import main
from tests.mlxkv import bundles as gen

HERE = Path(__file__).resolve().parents[1] / "mlxkv" / "bundles"
EXPECTED = json.loads((HERE / "expected.json").read_text())


def test_generator_reproduces_the_committed_files(tmp_path: Path) -> None:
    assert gen.generate(tmp_path) == EXPECTED
    for path in sorted(p for p in tmp_path.rglob("*") if p.is_file()):
        assert path.read_bytes() == (HERE / path.relative_to(tmp_path)).read_bytes(), path.name


def check_turn(snap: kvformat.Snapshot, model: gen.Model, tokens: int, generated: list[int]) -> None:
    """Snapshot ``snap`` holds turn ``tokens`` of ``model``: every head's K/V and positions, the
    token ids, the generated ids and the logits."""
    numpy_dtype = np.float32 if model.dtype == "float32" else np.dtype(model.dtype)
    for layer in range(gen.LAYERS):
        first = tokens - gen.WINDOWS.get(layer, tokens)
        for head in range(gen.HEADS):
            h = snap.head(layer, head)
            np.testing.assert_array_equal(h.positions, np.arange(first, tokens))
            np.testing.assert_array_equal(h.k, model.k[layer][head, first:tokens].astype(numpy_dtype))
            np.testing.assert_array_equal(h.v, model.v[layer][head, first:tokens].astype(numpy_dtype))
            assert h.k.dtype == numpy_dtype
    meta = snap.snapshot_metadata
    assert meta["tokens"] == [model.tokens[:tokens]]
    assert meta["generated_ids"] == [generated] and meta["generated"] == len(generated)
    np.testing.assert_array_equal(snap.array("last_logits"), np.linspace(-1, 1, 8, dtype=np.float32)[None])


@pytest.mark.parametrize("name", EXPECTED["golden"])
def test_golden_logs_and_containers_import_every_turn(tmp_path: Path, name: str) -> None:
    out = tmp_path / "out.kv"
    report = import_bundles(HERE / name, out)
    model = gen.model(0, "float16" if "float16" in name else "float32")
    assert (report.bundles, report.blocks) == (2, 7)
    # turn 2 keeps turn 1's first block; its second block differs (the sliding layer left it)
    assert report.stored_blocks == 6
    for index, (tokens, generated) in enumerate(zip(gen.TURNS, gen.GENERATED, strict=True)):
        with kvformat.open(out, snapshot=index) as snap:
            check_turn(snap, model, tokens, generated)
            bundle = snap.snapshot_metadata["bundle"]
            assert bundle["uri"] == f"mlx://bundle/turn-{index + 1}"
            assert bundle["blocks"][0] == [0, 4] and sum(c for _, c in bundle["blocks"]) == tokens
    with kvformat.open(out) as snap:
        assert snap.snapshot_metadata["bundle"]["kept_from_previous_snapshot"] == 1
        assert snap.snapshot_metadata["bundle"]["blocks_seen_before"] == [0]
        source = snap.metadata["source"]
        assert source["bundles"] == ["mlx://bundle/turn-1", "mlx://bundle/turn-2"]
        assert ("container" in source) == name.endswith(".kv")
        assert snap.layers[1].attributes["window"] == 6 and snap.layers[1].attributes["kind"] == "sliding"


def test_one_bundle_by_uri_and_a_manifest_file(tmp_path: Path) -> None:
    model = gen.model(0)
    import_bundles(HERE / "two-turns.mvlog", tmp_path / "one.kv", bundle="mlx://bundle/turn-1")
    with kvformat.open(tmp_path / "one.kv") as snap:
        assert snap.num_snapshots == 1
        check_turn(snap, model, gen.TURNS[0], gen.GENERATED[0])
    with pytest.raises(errors.KVFormatError, match="no bundle with URI 'mlx://nope'"):
        import_bundles(HERE / "two-turns.mvlog", tmp_path / "none.kv", bundle="mlx://nope")
    # a manifest kept as JSON beside its log: found by the basename of its refs' segment, else
    # as the only *.mvlog there
    folder = tmp_path / "copy"
    shutil.copytree(HERE / "manifest-dir", folder)
    import_bundles(folder / "turn-1.json", tmp_path / "manifest.kv")
    (folder / "session.mvlog").rename(folder / "renamed.mvlog")
    import_bundles(folder / "turn-1.json", tmp_path / "renamed.kv")
    for name in ("manifest.kv", "renamed.kv"):
        with kvformat.open(tmp_path / name) as snap:
            check_turn(snap, model, gen.TURNS[0], gen.GENERATED[0])
    (folder / "other.mvlog").write_bytes(b"")
    with pytest.raises(errors.KVFormatError, match="cannot find the State log"):
        import_bundles(folder / "turn-1.json", tmp_path / "lost.kv")
    assert not (tmp_path / "none.kv").exists() and not (tmp_path / "lost.kv").exists()


def test_listing(capsys: pytest.CaptureFixture[str]) -> None:
    rows = list_bundles(HERE / "container.kv")
    assert [
        (r["uri"], r["tokens"], r["blocks"], r["reused_blocks"], r["shared_with_earlier"]) for r in rows
    ] == [
        ("mlx://bundle/turn-1", 10, 3, 0, 0),
        ("mlx://bundle/turn-2", 14, 4, 1, 1),
    ]
    assert main(["import-mlxkv", str(HERE / "two-turns.mvlog"), "--list"]) == 0
    printed = capsys.readouterr().out
    assert "2 bundle(s)" in printed and "mlx://bundle/turn-2" in printed and "14 tokens, 4 blocks" in printed


@pytest.mark.parametrize("name", sorted(EXPECTED["hostile"]))
def test_hostile_bundles_are_refused_cleanly(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.kv"
    tracemalloc.start()
    try:
        with pytest.raises(errors.KVFormatError) as info:
            import_bundles(HERE / "bad" / name, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert type(info.value).__name__ == EXPECTED["hostile"][name], str(info.value)
    assert str(HERE / "bad" / name) in str(info.value)
    assert peak < 16 << 20
    assert not out.exists() and not Path(f"{out}.partial").exists()
    assert main(["import-mlxkv", str(HERE / "bad" / name), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and EXPECTED["hostile"][name] in err
    assert not out.exists()


def test_truncation_anywhere_is_refused(tmp_path: Path) -> None:
    data = (HERE / "container.kv").read_bytes()
    src, out = tmp_path / "cut.kv", tmp_path / "out.kv"
    for cut in range(0, len(data), 41):
        src.write_bytes(data[:cut])
        with pytest.raises(errors.KVFormatError):
            import_bundles(src, out)
        assert not out.exists() and not Path(f"{out}.partial").exists(), cut


def test_memory_is_bounded_by_one_block(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    # blocks larger than what the writer gathers before it writes (16 MiB)
    layers, heads, dim, tokens, block = 8, 8, 128, 3072, 512
    model = gen.Model(
        [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)],
        [rng.standard_normal((heads, tokens, dim)).astype(np.float16) for _ in range(layers)],
        list(range(tokens)),
        "float16",
    )
    saved = (gen.LAYERS, gen.HEADS, gen.DIM, gen.TOTAL, gen.WINDOWS)
    gen.LAYERS, gen.HEADS, gen.DIM, gen.TOTAL, gen.WINDOWS = layers, heads, dim, tokens, {}
    try:
        log = gen.LogWriter()
        gen.save_bundle(log, model, tokens, "mlx://big", block_size=block)
    finally:
        gen.LAYERS, gen.HEADS, gen.DIM, gen.TOTAL, gen.WINDOWS = saved
    src = tmp_path / "big.mvlog"
    src.write_bytes(bytes(log.data))
    block_bytes = layers * heads * 2 * block * dim * 2
    tracemalloc.start()
    try:
        import_bundles(src, tmp_path / "big.kv")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert src.stat().st_size > 5.9 * block_bytes
    assert peak < 3 * block_bytes, f"peak {peak} for {block_bytes}-byte blocks"
    with kvformat.open(tmp_path / "big.kv") as snap:
        np.testing.assert_array_equal(snap.head(3, 2).k, model.k[3][2])


def test_opening_a_log_or_container_names_the_import_command() -> None:
    for name, what in (("two-turns.mvlog", "State log"), ("container.kv", "KVST container")):
        with pytest.raises(errors.ForeignFormatError, match=f"go-mlx {what}.*kvsnap import "):
            kvformat.open(HERE / name)
