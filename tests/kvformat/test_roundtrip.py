"""Property tests: random snapshots over every dtype, codec, chunk size and shape round-trip
bit-exactly through save/open, from a path (mmap) and from a file object."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvformat
from kvformat import dtypes

DTYPES = [d.name for d in dtypes.ALL]
CODECS = [*kvformat.codecs.NAMES, "zstd:1"]


@st.composite
def snapshots(draw: st.DrawFn) -> dict:
    num_seqs = draw(st.integers(1, 3))
    layers = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()) and draw(st.booleans()):
            layers.append(None)
            continue
        heads = draw(st.integers(1, 3))
        k_dim, v_dim = draw(st.integers(1, 9)), draw(st.integers(1, 9))
        dtype = dtypes.from_name(draw(st.sampled_from(DTYPES)))
        per_seq = []
        for _ in range(num_seqs):
            positions = sorted(draw(st.sets(st.integers(0, 80), max_size=25)))
            per_seq.append(np.array(positions, dtype=np.int64))
        layers.append((heads, k_dim, v_dim, dtype, per_seq))
    return {
        "layers": layers,
        "num_seqs": num_seqs,
        "codec": draw(st.sampled_from(CODECS)),
        "chunk_bytes": draw(st.integers(1, 400)),
        "metadata": draw(st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=4)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: kvformat.DType) -> np.ndarray:
    """Arbitrary bit patterns (NaNs, infinities, subnormals included) in the given dtype."""
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype.numpy).reshape(shape)


def build(case: dict) -> list[kvformat.Layer | None]:
    rng = np.random.default_rng(case["seed"])
    out: list[kvformat.Layer | None] = []
    for layer in case["layers"]:
        if layer is None:
            out.append(None)
            continue
        heads, k_dim, v_dim, dtype, per_seq = layer
        ks = [random_bits(rng, (heads, p.size, k_dim), dtype) for p in per_seq]
        vs = [random_bits(rng, (heads, p.size, v_dim), dtype) for p in per_seq]
        out.append(kvformat.Layer(ks, vs, per_seq))
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check(snap: kvformat.Snapshot, case: dict, data: list[kvformat.Layer | None]) -> None:
    assert snap.num_layers == len(data)
    assert snap.num_seqs == case["num_seqs"]
    assert snap.metadata == case["metadata"]
    for index, layer in enumerate(data):
        if layer is None:
            assert snap.head(index, 0) is None
            assert not snap.layers[index].present
            continue
        for seq in range(case["num_seqs"]):
            for head in range(layer.k[seq].shape[0]):
                got = snap.head(index, head, seq)
                assert got is not None
                assert same_bits(got.k, layer.k[seq][head])
                assert same_bits(got.v, layer.v[seq][head])
                assert np.array_equal(got.positions, layer.positions[seq])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=snapshots())
def test_roundtrip_is_bit_exact(tmp_path: Path, case: dict) -> None:
    data = build(case)
    path = tmp_path / "case.kv"
    path.unlink(missing_ok=True)
    kvformat.save(
        path,
        data,
        metadata=case["metadata"],
        codec=case["codec"],
        chunk_bytes=case["chunk_bytes"],
        num_seqs=case["num_seqs"],
    )
    with kvformat.open(path) as snap:
        check(snap, case, data)
        report = snap.verify()
        assert report.chunks == snap.num_chunks
    with kvformat.open(io.BytesIO(path.read_bytes())) as snap:
        check(snap, case, data)


def test_raw_single_chunk_is_zero_copy_view(tmp_path: Path) -> None:
    k = np.arange(2 * 5 * 4, dtype=np.float32).reshape(2, 5, 4)
    path = tmp_path / "z.kv"
    kvformat.save(path, [kvformat.Layer(k, k)])
    with kvformat.open(path) as snap:
        head = snap.head(0, 1)
        assert head is not None
        assert not head.k.flags.owndata and not head.k.flags.writeable
        assert np.array_equal(head.k, k[1])


def test_keys_alone_leave_the_values_unread(tmp_path: Path) -> None:
    k = np.arange(1 * 6 * 2, dtype=np.float32).reshape(1, 6, 2)
    v = np.ones((1, 6, 3), np.float32)
    path = tmp_path / "k.kv"
    kvformat.save(path, [kvformat.Layer(k, v)], chunk_bytes=8)  # several chunks a head
    with kvformat.open(path) as snap:
        read: list[int] = []
        chunk_array = snap._file.chunk_array
        snap._file.chunk_array = lambda i, checked=False: read.append(i) or chunk_array(i, checked)  # type: ignore[method-assign]
        head = snap.head(0, 0, positions=(1, 5), values=False)
        assert (
            head is not None and np.array_equal(head.k, k[0, 1:5]) and head.positions.tolist() == [1, 2, 3, 4]
        )
        assert head.v.shape == (0, 3)
        kinds = snap._file.table["kind"][read]
        assert read and set(kinds.tolist()) == {
            int(snap._file.table["kind"][snap._segments.of_head(0, 0, 0)[0].k_chunk])
        }
        both = snap.head(0, 0, positions=(1, 5))
        assert both is not None and np.array_equal(both.v, v[0, 1:5])


def test_a_position_range_selects_absolute_positions(tmp_path: Path) -> None:
    k = np.arange(1 * 6 * 2, dtype=np.float32).reshape(1, 6, 2)
    positions = np.array([0, 1, 10, 11, 12, 30])
    path = tmp_path / "r.kv"
    kvformat.save(path, [kvformat.Layer(k, k, positions)], chunk_bytes=8)
    with kvformat.open(path) as snap:
        head = snap.head(0, 0, positions=(1, 12))
        assert head is not None
        assert head.positions.tolist() == [1, 10, 11]
        assert np.array_equal(head.k, k[0, 1:4])
        assert snap.seq_len == 31  # one past the largest position
        same = snap.head(0, 0, positions=range(1, 12))
        assert same is not None and same.positions.tolist() == [1, 10, 11]
        with pytest.warns(DeprecationWarning, match="now head"):
            old = snap.head(0, 0, tokens=(1, 12))  # the former name still works
        assert old is not None and old.positions.tolist() == [1, 10, 11]
        with pytest.raises(TypeError, match="not both"):
            snap.head(0, 0, positions=(1, 12), tokens=(1, 12))
        with pytest.raises(ValueError, match="step 1"):
            snap.head(0, 0, positions=range(0, 12, 2))


def test_zero_token_and_one_token_sequences(tmp_path: Path) -> None:
    empty = np.zeros((2, 0, 3), np.float16)
    one = np.ones((2, 1, 3), np.float16)
    path = tmp_path / "e.kv"
    kvformat.save(path, [kvformat.Layer([empty, one], [empty, one])])
    with kvformat.open(path) as snap:
        h0, h1 = snap.head(0, 1, seq=0), snap.head(0, 1, seq=1)
        assert h0 is not None and h0.k.shape == (0, 3) and h0.positions.size == 0
        assert h1 is not None and h1.k.shape == (1, 3) and h1.positions.tolist() == [0]
        assert snap.verify().chunks == 4


def test_out_of_range_arguments_raise_index_error(tmp_path: Path) -> None:
    k = np.zeros((1, 2, 2), np.float32)
    path = tmp_path / "i.kv"
    kvformat.save(path, [kvformat.Layer(k, k)])
    with kvformat.open(path) as snap:
        for args in ((1, 0), (0, 1), (-1, 0)):
            with pytest.raises(IndexError):
                snap.head(*args)
        with pytest.raises(IndexError):
            snap.head(0, 0, seq=1)


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    spec = kvformat.LayerSpec(1, 2, 2, kvformat.FLOAT32)
    with kvformat.Writer(tmp_path / "w.kv", [spec]) as w:
        with pytest.raises(TypeError, match="float32"):
            w.append(0, np.zeros((1, 1, 2), np.float16), np.zeros((1, 1, 2), np.float16))
        with pytest.raises(ValueError, match="shape"):
            w.append(0, np.zeros((1, 1, 3), np.float32), np.zeros((1, 1, 2), np.float32))
        w.append(0, np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 2), np.float32), [3, 4])
        with pytest.raises(ValueError, match="not after"):
            w.append(0, np.zeros((1, 1, 2), np.float32), np.zeros((1, 1, 2), np.float32), [4])
        with pytest.raises(ValueError, match="strictly increasing"):
            w.append(0, np.zeros((1, 2, 2), np.float32), np.zeros((1, 2, 2), np.float32), [9, 9])
        with pytest.raises(ValueError, match="plain JSON"):
            w.snapshot({"bad": float("nan")})
    with kvformat.open(tmp_path / "w.kv") as snap:
        head = snap.head(0, 0)
        assert head is not None and head.positions.tolist() == [3, 4]


def test_blocks_hold_keeps_the_same_stream(tmp_path: Path) -> None:
    """``blocks(hold=N)`` (pages released N blocks later, for threaded consumers) yields the same
    blocks; a negative hold is refused."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((3, 50, 8)).astype(np.float32)
    path = tmp_path / "hold.kv"
    kvformat.save(path, [kvformat.Layer(k, k), kvformat.Layer(k * 2, k)], chunk_bytes=20 * 8 * 4)
    with kvformat.open(path) as snap:
        plain = [(b.layer, b.head, b.k.copy(), b.positions.copy()) for b in snap.blocks()]
        held = list(snap.blocks(hold=4))
        assert len(held) == len(plain) > 6
        for (layer, head, rows, positions), block in zip(plain, held, strict=True):
            assert (block.layer, block.head) == (layer, head)
            np.testing.assert_array_equal(block.k, rows)
            np.testing.assert_array_equal(block.positions, positions)
        with pytest.raises(ValueError, match="hold must be a non-negative integer"):
            next(snap.blocks(hold=-1))
