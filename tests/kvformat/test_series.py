"""A series of snapshots in one file: shared chunks, sliding windows, selection by index."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvformat
from tests.conftest import pattern, write_series


def test_every_snapshot_reads_back(tmp_path: Path, codec: str) -> None:
    path = tmp_path / "series.kv"
    expected = write_series(path, codec)
    with kvformat.open(path) as last:
        assert last.num_snapshots == 3 and last.index == 2
        assert last.metadata == {"name": "série"}
        for index, held in enumerate(expected):
            snap = last.select(index)
            assert snap.snapshot_metadata == {"step": index}
            assert snap.head(2, 0) is None
            for layer, positions in held.items():
                for head in range(2):
                    got = snap.head(layer, head)
                    assert got is not None
                    assert got.positions.tolist() == positions.tolist()
                    assert np.array_equal(got.k, pattern(layer, head, positions, 8, "k"))
                    assert np.array_equal(got.v, pattern(layer, head, positions, 4, "v"))
        last.verify()


def test_sliding_window_keeps_prefix_and_window(tmp_path: Path) -> None:
    expected = write_series(tmp_path / "s.kv")
    assert expected[-1][1].tolist() == [0, 11, 12, 13, 14, 15]
    with kvformat.open(tmp_path / "s.kv", snapshot=0) as first:
        assert first.positions(1).tolist() == [0, 1, 2, 3, 4]


def test_series_stores_shared_chunks_once(tmp_path: Path) -> None:
    """n snapshots of a growing cache cost O(n) bytes: each chunk is written once."""
    spec = kvformat.LayerSpec(4, 64, 64, kvformat.FLOAT16)
    step_tokens, steps = 16, 12
    rng = np.random.default_rng(0)
    with kvformat.Writer(tmp_path / "grow.kv", [spec] * 2) as w:
        for _ in range(steps):
            for layer in range(2):
                k = rng.standard_normal((4, step_tokens, 64)).astype(np.float16)
                w.append(layer, k, k)
            w.snapshot()
    payload = steps * step_tokens * 2 * 4 * 64 * 2 * 2  # tokens, layers, heads, dim, K+V, bytes
    size = (tmp_path / "grow.kv").stat().st_size
    assert payload <= size < payload * 1.5
    with kvformat.open(tmp_path / "grow.kv") as snap:
        assert snap.seq_len == steps * step_tokens
        assert snap.select(3).seq_len == 4 * step_tokens


def test_blocks_stream_every_segment_once(tmp_path: Path) -> None:
    write_series(tmp_path / "b.kv", chunk_bytes=64)
    with kvformat.open(tmp_path / "b.kv") as snap:
        seen: dict[tuple[int, int], list[int]] = {}
        for block in snap.blocks():
            assert np.array_equal(block.k, pattern(block.layer, block.head, block.positions, 8, "k"))
            seen.setdefault((block.layer, block.head), []).extend(block.positions.tolist())
        for (layer, head), positions in seen.items():
            whole = snap.head(layer, head)
            assert whole is not None and sorted(positions) == whole.positions.tolist()


def test_arrays_attach_to_snapshots(tmp_path: Path, codec: str) -> None:
    spec = kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32)
    logits = [np.linspace(-1, 1, 50, dtype=np.float32) * i for i in range(3)]
    with kvformat.Writer(tmp_path / "a.kv", [spec], codec=codec) as w:
        for step in range(3):
            w.append(0, np.ones((1, 2, 4), np.float32), np.ones((1, 2, 4), np.float32))
            w.snapshot({"step": step}, arrays={"last_logits": logits[step]} if step != 1 else None)
    with kvformat.open(tmp_path / "a.kv") as snap:
        got = snap.array("last_logits")
        assert got is not None and got.shape == (1, 50)
        assert np.array_equal(got[0], logits[2])
        assert snap.select(1).array("last_logits") is None
        assert snap.select(0).array_names == ["last_logits"]
        assert np.array_equal(snap.select(0).array("last_logits")[0], logits[0])  # type: ignore[index]
        assert snap.seq_len == 6
        snap.verify()


def test_streaming_keeps_resident_memory_bounded(tmp_path: Path) -> None:
    """blocks() releases each chunk's pages: a full pass over a 256 MB file stays far below it."""
    import subprocess
    import sys

    spec = kvformat.LayerSpec(8, 128, 128, kvformat.FLOAT16)
    rng = np.random.default_rng(0)
    path = tmp_path / "big.kv"
    with kvformat.Writer(path, [spec] * 8) as w:
        for layer in range(8):
            k = rng.standard_normal((8, 8192, 128)).astype(np.float16)
            w.append(layer, k, k)
    code = (
        "import kvformat, resource, sys\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "total = 0.0\n"
        "with kvformat.open(sys.argv[1]) as snap:\n"
        "    for block in snap.blocks():\n"
        "        total += float(block.k.sum(dtype='float32')) + float(block.v.sum(dtype='float32'))\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n"
    )
    grown = int(
        subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True
        ).stdout
    )
    assert grown < path.stat().st_size / 4, (grown, path.stat().st_size)


def test_positions_dropped_from_the_end_may_be_appended_again(tmp_path: Path) -> None:
    """A trimmed cache (rejected draft tokens): after ``drop(layer, 4, 100)`` on a layer holding
    0..19, the next append continues at 4 and the snapshot holds the new rows there, the old
    ones gone; positions still inside the live state cannot be appended again."""
    spec = kvformat.LayerSpec(1, 4, 4, kvformat.dtypes.from_numpy(np.dtype(np.float32)))
    old = np.arange(20 * 4, dtype=np.float32).reshape(1, 20, 4)
    new = -np.arange(16 * 4, dtype=np.float32).reshape(1, 16, 4)
    path = tmp_path / "trim.kv"
    with kvformat.Writer(path, [spec]) as writer:
        writer.append(0, old, old)
        writer.snapshot()
        writer.drop(0, 4, 100)
        writer.append(0, new, new)  # positions 4..19 again, then 20..
        writer.snapshot()
        with pytest.raises(ValueError, match="not after"):
            writer.append(0, new[:, :1], new[:, :1], np.array([10]))
    with kvformat.open(path) as snap:
        head = snap.head(0, 0)
        assert head is not None
        np.testing.assert_array_equal(head.positions, np.arange(20))
        np.testing.assert_array_equal(head.k[:4], old[0, :4])
        np.testing.assert_array_equal(head.k[4:], new[0])
    with kvformat.open(path, 0) as first:
        np.testing.assert_array_equal(first.head(0, 0).k, old[0])  # type: ignore[union-attr]


def test_byte_span_covers_the_chunks_of_segments_and_release_span_keeps_views_valid(tmp_path: Path) -> None:
    """`Pages.byte_span` runs from the first record of the segments' chunks to the end of
    the last; releasing it (`release_span`: the pass's workers drop a window's pages) leaves
    every view handed out reading the same values (the pages fault back in)."""
    from kvformat.layout import DESCRIPTOR_SIZE

    path = tmp_path / "series.kv"
    write_series(path)
    with kvformat.open(path) as snap:
        segments = snap.segments()
        table = snap._file.table
        chunks = [c for s in segments for c in (s.k_chunk, s.v_chunk)]
        starts = table["offset"][chunks].astype(np.int64)
        ends = starts + DESCRIPTOR_SIZE + table["stored_size"][chunks].astype(np.int64)
        assert kvformat.pages.of(snap).byte_span(segments) == (int(starts.min()), int(ends.max()))
        assert kvformat.pages.of(snap).byte_span(segments[1:2]) == (
            int(starts[2:4].min()),
            int(ends[2:4].max()),
        )
        heads = [snap.read(s) for s in segments]
        copies = [(h.k.copy(), h.v.copy()) for h in heads]
        kvformat.pages.of(snap).release_span(*kvformat.pages.of(snap).byte_span(segments))
        kvformat.pages.of(snap).release_span(10, 10)  # empty: nothing to do
        for head, (k, v) in zip(heads, copies, strict=True):
            np.testing.assert_array_equal(head.k, k)
            np.testing.assert_array_equal(head.v, v)


def test_release_merges_the_chunks_of_segments_given_in_any_order(tmp_path: Path) -> None:
    """`Pages.release` drops each distinct chunk of the segments once, neighbouring chunks in one
    range, whatever the segments' order and repeats (the same ranges as from the sorted set)."""
    from kvformat.layout import DESCRIPTOR_SIZE

    path = tmp_path / "series.kv"
    write_series(path)
    with kvformat.open(path) as snap:
        segments = snap.segments()
        table = snap._file.table
        released: list[tuple[int, int]] = []
        snap._file.source.release = lambda offset, size: released.append((offset, size))  # type: ignore[method-assign]
        kvformat.pages.of(snap).release(list(reversed(segments)) + segments[:2])
        chunks = sorted({c for s in segments for c in (s.k_chunk, s.v_chunk)})
        starts = table["offset"][chunks].astype(np.int64)
        ends = starts + DESCRIPTOR_SIZE + table["stored_size"][chunks].astype(np.int64)
        assert released and released[0][0] == int(starts[0])
        assert sum(size for _, size in released) <= int(ends[-1] - starts[0])
        assert released[-1][0] + released[-1][1] == int(ends[-1])
        covered = [(start, start + size) for start, size in released]
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):  # every chunk inside one range
            assert any(low <= start and end <= high for low, high in covered)
        released.clear()
        kvformat.pages.of(snap).release(segments[0])
        first = min(segments[0].k_chunk, segments[0].v_chunk)
        assert released[0][0] == int(table["offset"][first])
