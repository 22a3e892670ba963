"""The writer's pipelined path (helper thread gathers, encodes and checksums while the caller
writes) produces exactly the bytes of the serial path, for strided inputs, split chunks, gaps in
positions, bf16 and every codec; and its low-level write survives short writes."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import kvformat
import kvformat.encode
from kvformat import writer as writer_module


def _strided(rng: np.random.Generator, heads: int, tokens: int, dim: int, dtype: Any) -> np.ndarray:
    """``(heads, tokens, dim)`` as a transposed view of ``(tokens, heads, dim)``, the way
    attention produces V: no head is C-contiguous."""
    return rng.standard_normal((tokens, heads, dim)).astype(dtype).transpose(1, 0, 2)


def _write(path: Path, codec: str, pipelined: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(11)
    specs = [
        kvformat.LayerSpec(3, 8, 6, kvformat.FLOAT32),
        kvformat.LayerSpec(2, 16, 16, kvformat.BFLOAT16),
        None,
        kvformat.LayerSpec(4, 4, 4, kvformat.FLOAT16),
    ]
    items: list[tuple[Any, ...]] = []
    for layer, spec in enumerate(specs):
        if spec is None:
            continue
        assert spec.dtype is not None
        tokens = 40 + 7 * layer
        k = _strided(rng, spec.num_heads, tokens, spec.k_dim, spec.dtype.numpy)
        v = _strided(rng, spec.num_heads, tokens, spec.v_dim, spec.dtype.numpy)
        positions = (
            np.arange(tokens)
            if layer != 3
            else np.concatenate([np.arange(5), np.arange(20, 20 + tokens - 5)])
        )
        items.append((layer, k, v, positions, 0))
    monkeypatch.setattr(writer_module, "_UNIT_BYTES", 700 if pipelined else 1 << 30)
    with kvformat.Writer(path, specs, codec=codec, chunk_bytes=200) as w:
        w.pipeline_bytes = 0 if pipelined else 1 << 62
        w.append_many(items)
        w.snapshot({"step": 0})
        # A second call continues each layer's positions by default.
        more = [(layer, k[:, :3], v[:, :3], None, 0) for layer, k, v, _, _ in items]
        w.append_many(more)
    return items


@pytest.mark.parametrize("codec", kvformat.codecs.NAMES)
def test_pipelined_bytes_equal_serial_bytes(
    tmp_path: Path, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    serial, pipelined = tmp_path / "serial.kv", tmp_path / "pipelined.kv"
    items = _write(serial, codec, False, monkeypatch)
    _write(pipelined, codec, True, monkeypatch)
    assert serial.read_bytes() == pipelined.read_bytes()
    with kvformat.open(pipelined) as snap:
        assert snap.verify().snapshots == 2  # raises on any bad checksum
        for layer, k, v, positions, _ in items:
            for head in range(k.shape[0]):
                got = snap.head(layer, head)
                assert got is not None
                np.testing.assert_array_equal(got.k[: k.shape[1]], k[head])
                np.testing.assert_array_equal(got.v[: k.shape[1]], v[head])
                np.testing.assert_array_equal(got.k[k.shape[1] :], k[head, :3])
                last = int(positions[-1])
                assert got.positions.tolist() == [*positions.tolist(), last + 1, last + 2, last + 3]


def test_a_bad_item_writes_nothing_of_its_call(tmp_path: Path) -> None:
    spec = kvformat.LayerSpec(2, 4, 4, kvformat.FLOAT32)
    ok = np.ones((2, 5, 4), np.float32)
    with kvformat.Writer(tmp_path / "x.kv", [spec, spec]) as w:
        before = w._offset
        with pytest.raises(TypeError, match="layer 1 v is float64"):
            w.append_many([(0, ok, ok, None, 0), (1, ok, ok.astype(np.float64), None, 0)])
        assert w._offset == before and w.next_position(0) == 0
        w.append_many([(0, ok, ok, None, 0), (1, ok, ok, None, 0)])
    with kvformat.open(tmp_path / "x.kv") as snap:
        head = snap.head(1, 1)
        assert head is not None and head.positions.tolist() == [0, 1, 2, 3, 4]


def test_short_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``writev`` may write less than asked (signals, pipes, some file systems): the writer
    goes on from the exact byte where it stopped."""
    reference = tmp_path / "reference.kv"
    _write(reference, "raw", True, monkeypatch)
    real_writev = os.writev
    calls = []

    def stingy(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        budget, first = 100, []  # at most 100 bytes, often ending inside a buffer
        for buffer in buffers:
            first.append(buffer[:budget])
            budget -= len(first[-1])
            if not budget:
                break
        return real_writev(fd, first)

    monkeypatch.setattr(os, "writev", stingy)
    short = tmp_path / "short.kv"
    _write(short, "raw", True, monkeypatch)
    assert len(calls) > short.stat().st_size // 100
    assert short.read_bytes() == reference.read_bytes()


def test_bfloat16_strided_views_are_gathered(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    k = _strided(rng, 2, 33, 8, ml_dtypes.bfloat16)
    spec = kvformat.LayerSpec(2, 8, 8, kvformat.BFLOAT16)
    with kvformat.Writer(tmp_path / "b.kv", [spec]) as w:
        w.pipeline_bytes = 0
        w.append(0, k, k[:, ::-1])
    with kvformat.open(tmp_path / "b.kv") as snap:
        for head in range(2):
            got = snap.head(0, head)
            assert got is not None
            assert got.k.tobytes() == np.ascontiguousarray(k[head]).tobytes()
            assert got.v.tobytes() == np.ascontiguousarray(k[head, ::-1]).tobytes()


def _quantized_parts(rng: np.random.Generator, heads: int, tokens: int, dim: int) -> tuple[np.ndarray, ...]:
    """4-bit, group 32: ``(packed (heads, tokens, dim/8) uint32, scales, biases (heads, tokens, dim/32))``."""
    packed = rng.integers(0, 2**32, (heads, tokens, dim // 8), dtype=np.uint32)
    scales = rng.standard_normal((heads, tokens, dim // 32)).astype(np.float16)
    biases = rng.standard_normal((heads, tokens, dim // 32)).astype(np.float16)
    return packed, scales, biases


def test_quantized_layer_and_head_appends_store_the_parts_exactly(tmp_path: Path) -> None:
    from kvformat.quantization import Quantization

    rng = np.random.default_rng(5)
    spec = kvformat.LayerSpec(2, 64, 64, kvformat.FLOAT16, quantization=Quantization(4, 32))
    k, v = _quantized_parts(rng, 2, 10, 64), _quantized_parts(rng, 2, 10, 64)
    k_more, v_more = _quantized_parts(rng, 1, 3, 64), _quantized_parts(rng, 1, 3, 64)
    path = tmp_path / "q.kv"
    with kvformat.Writer(path, [spec]) as writer:
        writer.append(0, k, v)
        writer.append_head(0, 1, tuple(p[0] for p in k_more), tuple(p[0] for p in v_more), np.arange(10, 13))
    with kvformat.open(path) as snap:
        stored = snap.quantized_head(0, 1)
        assert stored is not None
        (k_parts, v_parts, positions) = stored
        assert positions.tolist() == list(range(13))
        for got, whole, more in zip(k_parts + v_parts, k + v, k_more + v_more, strict=True):
            np.testing.assert_array_equal(got, np.concatenate([whole[1], more[0]]))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda parts: parts[:2], TypeError, "k: a quantized layer takes (packed, scales, biases)"),
        (lambda parts: (parts[0].astype(np.int32), *parts[1:]), ValueError, "k: packed must be uint32"),
        (lambda parts: (parts[0], parts[1].astype(np.float32), parts[2]), ValueError, "k: scales must be"),
        (lambda parts: (parts[0], parts[1], parts[2][..., :1]), ValueError, "k: biases must be"),
        (lambda parts: (parts[0][..., :1, :], *parts[1:]), ValueError, "k: scales must be"),
    ],
)
def test_quantized_appends_are_checked_and_write_nothing_when_wrong(
    tmp_path: Path, change: Any, error: type[Exception], message: str
) -> None:
    from kvformat.quantization import Quantization

    rng = np.random.default_rng(6)
    spec = kvformat.LayerSpec(2, 64, 64, kvformat.FLOAT16, quantization=Quantization(4, 32))
    k, v = _quantized_parts(rng, 2, 5, 64), _quantized_parts(rng, 2, 5, 64)
    path = tmp_path / "bad.kv"
    with kvformat.Writer(path, [spec]) as writer:
        with pytest.raises(error, match="layer 0 " + re.escape(message)):
            writer.append(0, change(k), v)
        with pytest.raises(error, match="layer 0 head 0 " + re.escape(message)):
            writer.append_head(0, 0, change(tuple(p[0] for p in k)), tuple(p[0] for p in v), np.arange(5))
        assert writer.next_position(0) == 0
    with kvformat.open(path) as snap:
        assert snap.seq_len == 0


def _write_blocks(path: Path, monkeypatch: pytest.MonkeyPatch, *, small: bool, pipelined: bool) -> None:
    """Contiguous appends (one `Block` per layer): layers of several shapes and dtypes, K and V
    of different widths, payloads that need padding, an absent layer, several snapshots."""
    rng = np.random.default_rng(5)
    specs = [
        kvformat.LayerSpec(3, 8, 6, kvformat.FLOAT32),
        kvformat.LayerSpec(3, 8, 6, kvformat.FLOAT32),
        kvformat.LayerSpec(2, 16, 16, kvformat.BFLOAT16),
        None,
        kvformat.LayerSpec(4, 5, 5, kvformat.FLOAT16),
        kvformat.LayerSpec(4, 5, 5, kvformat.FLOAT16),
    ]
    monkeypatch.setattr(kvformat.records, "SMALL_CHUNK_BYTES", 64 << 10 if small else 0)
    monkeypatch.setattr(writer_module, "_UNIT_BYTES", 600 if pipelined else 1 << 30)
    with kvformat.Writer(path, specs) as w:
        w.pipeline_bytes = 0 if pipelined else 1 << 62
        for step, tokens in enumerate([7, 7, 1, 16, 16, 3]):  # repeated shapes reuse a plan
            items = []
            for layer, spec in enumerate(specs):
                if spec is None:
                    continue
                assert spec.dtype is not None
                k = rng.standard_normal((spec.num_heads, tokens, spec.k_dim)).astype(spec.dtype.numpy)
                v = rng.standard_normal((spec.num_heads, tokens, spec.v_dim)).astype(spec.dtype.numpy)
                items.append((layer, k, v, None, 0))
            w.append_many(items)
            w.snapshot({"step": step})


@pytest.mark.parametrize("pipelined", [False, True])
def test_small_blocks_in_one_buffer_equal_the_records_chunk_by_chunk(
    tmp_path: Path, pipelined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small contiguous chunks are laid out in one buffer with numpy (`block_records`); the bytes
    are exactly those of the chunk-by-chunk layout, and the file verifies."""
    laid_out = []
    real = kvformat.encode.block_records

    def spy(*args: Any) -> Any:
        laid_out.append(len(args[0]))
        return real(*args)

    monkeypatch.setattr(kvformat.encode, "block_records", spy)
    one_buffer, chunk_by_chunk = tmp_path / "one.kv", tmp_path / "each.kv"
    _write_blocks(one_buffer, monkeypatch, small=True, pipelined=pipelined)
    assert laid_out and (max(laid_out) > 1 if not pipelined else len(laid_out) > 4)
    laid_out.clear()
    _write_blocks(chunk_by_chunk, monkeypatch, small=False, pipelined=pipelined)
    assert not laid_out
    assert one_buffer.read_bytes() == chunk_by_chunk.read_bytes()
    with kvformat.open(one_buffer) as snap:
        assert snap.verify().snapshots == 6


def _appended_series(path: Path, *, per_layer: bool, reuse: bool = False) -> np.ndarray:
    """Six snapshots of 3 layers, 2 heads, 5 tokens each (a strided V among them), written with
    `append` per layer or one `append_many`; with ``reuse`` the caller overwrites its buffer
    after each call. Returns what was appended, ``(snapshots, layers, 2, heads, 5, dim)``."""
    specs = [kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT16)] * 3
    rng = np.random.default_rng(4)
    data = rng.standard_normal((6, 3, 2, 2, 5, 8)).astype(np.float16)
    buffer = np.empty((2, 2, 5, 8), np.float16)
    with kvformat.Writer(path, specs) as w:
        for step in range(6):
            items = []
            for layer in range(3):
                buffer[...] = data[step, layer]
                k, v = (buffer[0].copy(), buffer[1].copy()) if not reuse else (buffer[0], buffer[1])
                if layer == 1:  # a strided view, as mlx-lm keeps V
                    v = np.ascontiguousarray(np.swapaxes(v, 0, 1)).swapaxes(0, 1)
                if per_layer:
                    w.append(layer, k, v)
                    if reuse:
                        buffer[...] = 0  # the caller's next use of its buffer
                else:
                    items.append((layer, k, v, None, 0))
            if items:
                w.append_many(items)
            w.snapshot({"step": step})
    return data


def test_append_per_layer_writes_the_bytes_of_append_many(tmp_path: Path) -> None:
    """`append` gathers small items until the snapshot: the file is byte for byte the one
    `append_many` writes, and reads back the data."""
    data = _appended_series(tmp_path / "per-layer.kv", per_layer=True)
    _appended_series(tmp_path / "many.kv", per_layer=False)
    assert (tmp_path / "per-layer.kv").read_bytes() == (tmp_path / "many.kv").read_bytes()
    with kvformat.open(tmp_path / "per-layer.kv", 5) as snap:
        head = snap.head(1, 1)
        assert head is not None
        np.testing.assert_array_equal(head.k, data[:, 1, 0, 1].reshape(-1, 8))
        np.testing.assert_array_equal(head.v, data[:, 1, 1, 1].reshape(-1, 8))


def test_append_keeps_what_the_buffer_held_when_called(tmp_path: Path) -> None:
    """A caller that reuses its arrays right after `append` returns: the file holds the values
    at the call (gathered items are copies)."""
    data = _appended_series(tmp_path / "reused.kv", per_layer=True, reuse=True)
    with kvformat.open(tmp_path / "reused.kv") as snap:
        for layer in range(3):
            head = snap.head(layer, 0)
            assert head is not None
            np.testing.assert_array_equal(head.k, data[:, layer, 0, 0].reshape(-1, 8))


def test_gathered_appends_are_written_past_the_bound_and_kept_on_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `GATHER_BYTES` gathered appends are written at once; an error inside ``with`` still
    writes what was gathered, so `recover` rebuilds it."""
    monkeypatch.setattr(writer_module, "GATHER_BYTES", 1000)
    specs = [kvformat.LayerSpec(2, 8, 8, kvformat.FLOAT32)] * 2
    k = np.ones((2, 4, 8), np.float32)  # 256 bytes: gathered
    path = tmp_path / "crash.kv"
    with pytest.raises(RuntimeError), kvformat.Writer(path, specs) as w:
        partial = Path(w.partial_path)
        size = partial.stat().st_size
        w.append(0, k, k)
        assert partial.stat().st_size == size  # gathered, not written
        w.append(1, k, k)
        w.append(0, k * 2, k * 2)
        w.append(1, k * 2, k * 2)  # 1024 bytes wait: past the bound, written
        assert partial.stat().st_size > size
        size = partial.stat().st_size
        w.append(0, k * 3, k * 3)
        assert partial.stat().st_size == size
        raise RuntimeError("the caller fails before the snapshot")
    report = kvformat.recover(partial, tmp_path / "recovered.kv")
    assert report.recovered_snapshot
    # layer 0 reached position 12, layer 1 position 8: the rebuilt snapshot ends at 8 on every head
    assert (report.cut_at, report.short_layers, report.rows_left_out) == (8, (1,), 8)
    with kvformat.open(tmp_path / "recovered.kv") as snap:
        for layer in range(2):
            head = snap.head(layer, 1)
            assert head is not None
            np.testing.assert_array_equal(head.k[:, 0], [1] * 4 + [2] * 4)


@pytest.mark.parametrize("dim", [3, 16])  # 3 x float32 rows: records with padding; 16: none
def test_raw_parts_read_back_and_verify(tmp_path: Path, dim: int) -> None:
    """Queries (strided, from a transposed view; a gap in positions; one head's run split at the
    chunk size) and a snapshot's arrays, written as raw parts whose columns are built for the
    run at once (`kvformat.encode`): every record reads back bit for bit, and verification
    checks every CRC."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((7, 4, dim)).astype(np.float32).transpose(1, 0, 2)  # (4 heads, 7, dim)
    spec = kvformat.LayerSpec(
        2, dim, dim, kvformat.FLOAT32, queries=kvformat.QuerySpec(4, dim, kvformat.FLOAT32, 0.5, [0, 0, 1, 1])
    )
    positions = np.array([0, 1, 2, 5, 6, 7, 8])
    path = tmp_path / "q.kv"
    with kvformat.Writer(path, [spec], chunk_bytes=4 * dim * 3) as w:  # 3 rows a chunk
        w.append(
            0,
            rng.standard_normal((2, 9, dim)).astype(np.float32),
            rng.standard_normal((2, 9, dim)).astype(np.float32),
        )
        w.append_queries(0, q, positions)
        w.snapshot(
            arrays={
                "odd": np.arange(5, dtype=np.float32).reshape(5, 1),
                "wide": np.ones((2, 7), np.float32),
            }
        )
    with kvformat.open(path) as snap:
        report = snap.verify()  # raises on any bad CRC or record
        assert report.chunks == snap.num_chunks and report.bytes_checked > 0
        for head in range(4):
            found = snap.queries(0, head)
            assert found is not None
            np.testing.assert_array_equal(found.positions, positions)
            assert found.q.tobytes() == np.ascontiguousarray(q[head]).tobytes()
        np.testing.assert_array_equal(snap.array("odd"), np.arange(5, dtype=np.float32).reshape(5, 1))
        np.testing.assert_array_equal(snap.array("wide"), np.ones((2, 7), np.float32))
