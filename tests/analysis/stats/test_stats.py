"""The per-head statistics catalogue: streamed, mergeable results equal direct computations;
pre-RoPE keys recovered exactly; Arrow and Polars forms."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import polars as pl
import pytest

import kvformat
from kvsnap.analysis.engine.accumulator import HeadAccumulator
from kvsnap.analysis.engine.batch import head_stats
from kvsnap.analysis.engine.tables import head_stats_reader, stats_rows
from kvsnap.analysis.stats import GROUPS, stat_groups
from kvsnap.analysis.stats.rope import Rope, RopeError
from kvsnap.analysis.tools.token_table import token_table
from tests.factories import random_file

ROPE = {"rope": {"base": 10000.0, "dims": 16, "pairing": "half", "scaling": None}}


def make_file(path: Path, chunk_bytes: int, seed: int = 0) -> np.ndarray:
    """K ``(2, 96, 16)`` with scaled channels and a massive-value token at position 5 of head 1."""
    scales = np.linspace(0.5, 3, 16, dtype=np.float32)
    made = random_file(
        path,
        seed=seed,
        channel_scales=scales,
        spike=(1, 5, 40.0),
        v="k_prefix",
        v_dim=8,
        metadata=ROPE,
        chunk_bytes=chunk_bytes,
    )
    return made.k[0]


def test_statistics_equal_direct_computation(tmp_path: Path) -> None:
    k = make_file(tmp_path / "one.kv", chunk_bytes=1 << 20)
    row = next(r for r in stats_rows(tmp_path / "one.kv") if (r["head"], r["tensor"]) == (1, "k"))
    x = k[1].astype(np.float64)
    norms = np.linalg.norm(x, axis=1)
    assert row["n_tokens"] == 96
    np.testing.assert_allclose(row["norm_mean"], norms.mean(), rtol=1e-9)
    np.testing.assert_allclose(row["norm_sq_mean"], (norms**2).mean(), rtol=1e-9)
    np.testing.assert_allclose(row["norm_p50"], np.median(norms), rtol=0.03)
    np.testing.assert_allclose(row["channel_mean"], x.mean(0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(row["channel_var"], x.var(0), rtol=1e-9)
    centered = x - x.mean(0)
    kurtosis = (centered**4).mean(0) / x.var(0) ** 2 - 3
    np.testing.assert_allclose(row["channel_kurtosis"], kurtosis, rtol=1e-7)
    eig = np.sort(np.linalg.eigvalsh(np.cov(x.T, bias=True)))[::-1]
    # float32 Gram pieces (the massive row in float64): within the documented 1e-5 relative
    np.testing.assert_allclose(row["eigenvalues"], eig, rtol=1e-5, atol=1e-9)
    assert row["rank_90"] == int(np.searchsorted(np.cumsum(eig) / eig.sum(), 0.9) + 1)
    np.testing.assert_allclose(row["rank1_error"], 1 - eig[0] / eig.sum(), rtol=1e-5)
    assert row["massive_positions"][0] == 5 and row["massive_ratio"] > 10
    np.testing.assert_allclose(row["sink_ratio"], norms[0] / norms.mean(), rtol=1e-9)
    np.testing.assert_allclose(row["anisotropy"], np.linalg.norm((x / norms[:, None]).mean(0)), rtol=1e-9)
    band = x[:, :8] ** 2 + x[:, 8:] ** 2
    np.testing.assert_allclose(row["rope_band_energy"], band.sum(0) / band.sum(), rtol=1e-9)
    np.testing.assert_allclose(row["norm_by_position"][0], norms[0])
    np.testing.assert_allclose(row["norm_by_position"][3], norms[4:8].mean())
    assert row["quant2_token_error"] > row["quant4_token_error"] > row["quant8_token_error"] > 0
    assert row["quant2_channel_error"] > row["quant8_channel_error"] > 0


def test_streaming_in_small_chunks_equals_one_chunk(tmp_path: Path) -> None:
    make_file(tmp_path / "one.kv", chunk_bytes=1 << 20)
    make_file(tmp_path / "many.kv", chunk_bytes=32 * 16 * 4)  # 32-token chunks: same quant groups
    assert_same_statistics(stats_rows(tmp_path / "many.kv"), stats_rows(tmp_path / "one.kv"), ("file",))


def assert_same_statistics(
    rows: list[dict[str, object]], expected: list[dict[str, object]], skip: tuple[str, ...]
) -> None:
    """The rows of a pass over the same K/V read in other pieces: equal but for rounding (the
    Gram runs on float32 pieces whose bounds follow the chunks: 1e-5 relative there)."""
    for row, reference in zip(rows, expected, strict=True):
        for key, value in reference.items():
            if key in skip:
                continue
            loose = 1e-5 if key in GROUPS["spectrum"] else None
            if isinstance(value, float):
                np.testing.assert_allclose(row[key], value, rtol=loose or 1e-9, err_msg=key)
            elif isinstance(value, list) and value and isinstance(value[0], float):
                np.testing.assert_allclose(row[key], value, rtol=loose or 1e-7, atol=1e-12, err_msg=key)
            else:
                assert row[key] == value, key


def test_pre_rope_keys_are_recovered_exactly(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((1, 40, 16)).astype(np.float32)
    positions = np.arange(100, 140)
    for pairing, traditional in (("half", False), ("interleaved", True)):
        rotated = np.array(
            mx.fast.rope(
                mx.array(raw[None]), 16, traditional=traditional, base=10000.0, scale=1.0, offset=100
            )
        )[0]
        metadata = {"rope": {"base": 10000.0, "dims": 16, "pairing": pairing, "scaling": None}}
        path = tmp_path / f"{pairing}.kv"
        kvformat.save(path, [kvformat.Layer(rotated, rotated, positions)], metadata=metadata)
        rope = Rope.from_metadata(metadata, {}, 16)
        with kvformat.open(path) as snap:
            head = snap.head(0, 0)
            assert head is not None
            np.testing.assert_allclose(rope.rotate(head.k, head.positions, inverse=True), raw[0], atol=2e-5)
        pre = head_stats(path, keys="pre_rope").filter(pl.col("tensor") == "k").row(0, named=True)
        np.testing.assert_allclose(pre["channel_mean"], raw[0].mean(0), atol=1e-5)


def test_pre_rope_needs_a_rope_description(tmp_path: Path) -> None:
    k = np.ones((1, 4, 8), np.float32)
    kvformat.save(tmp_path / "x.kv", [kvformat.Layer(k, k)])
    with pytest.raises(RopeError, match="no 'rope'"):
        head_stats(tmp_path / "x.kv", keys="pre_rope")
    assert head_stats(tmp_path / "x.kv")["rope_band_energy"].null_count() == 2


def test_arrow_reader_and_token_table(tmp_path: Path) -> None:
    make_file(tmp_path / "a.kv", chunk_bytes=1 << 12)
    make_file(tmp_path / "b.kv", chunk_bytes=1 << 12, seed=3)
    reader = head_stats_reader([tmp_path / "a.kv", tmp_path / "b.kv"])
    table = reader.read_all()
    assert table.num_rows == 8 and set(table.column("tensor").to_pylist()) == {"k", "v"}
    tokens = token_table(tmp_path / "a.kv").filter(pl.col("head") == 1).sort("position").collect()
    assert tokens.height == 96 and tokens["position"].to_list() == list(range(96))
    assert tokens["token_id"].null_count() == tokens["token_text"].null_count() == 96  # none recorded
    top = tokens.sort("k_norm", descending=True)["position"][0]
    assert top == 5


def test_arrow_tables_are_built_as_pyarrow_builds_them() -> None:
    """`arrow_table` makes the table from numpy buffers (no ``pa.array``, whose first call
    imports pandas): the same schema and values as ``pa.Table.from_pylist``, for the column
    kinds the statistics produce, nulls, empty lists, and what it hands to ``pa.array``."""
    import pyarrow as pa

    from kvsnap.analysis.stats.arrow import arrow_table

    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 6))
        rows = []
        for i in range(n):
            rows.append(
                {
                    "file": f"f{i}é",
                    "layer": int(rng.integers(0, 40)),
                    "norm_mean": float(rng.standard_normal()),
                    "maybe": None if rng.random() < 0.4 else float(rng.random()),
                    "nothing": None,
                    "channel_mean": [float(x) for x in rng.standard_normal(int(rng.integers(0, 4)))],
                    "massive_positions": [int(x) for x in rng.integers(0, 100, int(rng.integers(0, 3)))],
                    "mixed": 1 if i % 2 else 2.5,
                    "flag": bool(i % 2),
                }
            )
        built, reference = arrow_table(rows), pa.Table.from_pylist(rows)
        assert built.schema == reference.schema
        assert built.equals(reference)


def _series_and_whole(tmp_path: Path, codec: str = "raw") -> tuple[Path, Path]:
    """The same K/V (3 layers x 2 heads x 96 tokens) written as a series appending 8 tokens
    per snapshot (every head interleaved in the file: small segments) and all at once."""
    rng = np.random.default_rng(11)
    scales = np.linspace(0.5, 3, 16, dtype=np.float32)
    k = (rng.standard_normal((3, 2, 96, 16)) * scales).astype(np.float32)
    v = rng.standard_normal((3, 2, 96, 8)).astype(np.float32)
    specs = [kvformat.LayerSpec(2, 16, 8, kvformat.FLOAT32)] * 3
    series, whole = tmp_path / "series.kv", tmp_path / "whole.kv"
    with kvformat.Writer(series, specs, codec=codec, metadata=ROPE) as w:
        for start in range(0, 96, 8):
            w.append_many(
                [
                    (layer, k[layer, :, start : start + 8], v[layer, :, start : start + 8], None, 0)
                    for layer in range(3)
                ]
            )
            w.snapshot()
    with kvformat.Writer(whole, specs, metadata=ROPE) as w:
        for layer in range(3):
            w.append(layer, k[layer], v[layer])
        w.snapshot()
    return series, whole


@pytest.mark.parametrize("codec", ["raw", "zstd:1"])
def test_statistics_of_a_series_snapshot_equal_those_of_the_data_written_at_once(
    tmp_path: Path, codec: str
) -> None:
    """A series' last snapshot has small segments interleaved across heads: the pass regroups
    them by head (`plan.windows`) and reads each head's together (`Pages.read_many`);
    the statistics are those of the same K/V written at once."""
    from kvsnap.analysis.engine.plan import windows

    series, whole = _series_and_whole(tmp_path, codec)
    with kvformat.open(series) as snap:
        order = windows(snap)
        assert all(w.release for w in order)
        heads = [(s.layer, s.seq, s.head) for w in order for s in w.segments]
        assert heads == sorted(heads) and len(heads) == 3 * 2 * 12  # by head, within one window
    a, b = stats_rows(series), stats_rows(whole)
    big = tmp_path / "big.kv"  # segments of 2 MiB: read in file order
    data = np.zeros((2, 4096, 64), np.float32)
    with kvformat.Writer(big, [kvformat.LayerSpec(2, 64, 64, kvformat.FLOAT32)]) as w:
        w.append(0, data, data)
    with kvformat.open(big) as snap:
        assert [w.release for w in windows(snap)] == [False]
        assert windows(snap)[0].segments == snap.segments()
    assert_same_statistics(a, b, ("file", "snapshot"))


def test_read_many_joins_what_read_gives_and_checks_every_crc(tmp_path: Path) -> None:
    series, _ = _series_and_whole(tmp_path)
    with kvformat.open(series) as snap:
        segments = [s for s in snap.segments() if (s.layer, s.head) == (1, 1)]
        joined = kvformat.pages.of(snap).read_many(segments)
        one_by_one = [snap.read(s) for s in segments]
        np.testing.assert_array_equal(joined.k, np.concatenate([h.k for h in one_by_one]))
        np.testing.assert_array_equal(joined.v, np.concatenate([h.v for h in one_by_one]))
        np.testing.assert_array_equal(joined.positions, np.arange(96))
        with pytest.raises(ValueError, match="one head"):
            kvformat.pages.of(snap).read_many([segments[0], snap.segments()[0]])
        offset = int(snap._file.table["offset"][segments[5].v_chunk])
    raw = bytearray(series.read_bytes())
    raw[offset + 64 + 3] ^= 1
    series.write_bytes(bytes(raw))
    with kvformat.open(series) as snap, pytest.raises(kvformat.ChecksumError, match="payload CRC-32C"):
        kvformat.pages.of(snap).read_many([s for s in snap.segments() if (s.layer, s.head) == (1, 1)])


def test_arrow_tables_from_array_rows_equal_those_from_list_rows(tmp_path: Path) -> None:
    """The pass builds its tables from rows whose vector columns are numpy arrays
    (`HeadAccumulator.row_arrays`); they equal the tables of the same rows as lists, for every
    group (RoPE bands present and absent: a null column)."""
    from kvsnap.analysis.engine.accumulator import HeadAccumulator
    from kvsnap.analysis.stats.arrow import arrow_table
    from kvsnap.analysis.stats.rope import Rope

    rng = np.random.default_rng(8)
    accumulators = [HeadAccumulator(16, Rope(10000.0, 16, "half") if i % 2 else None) for i in range(4)]
    for acc in accumulators:
        acc.add(rng.standard_normal((40, 16)).astype(np.float32), np.arange(40))
    with_arrays = arrow_table([acc.row_arrays() for acc in accumulators])
    with_lists = arrow_table([acc.row() for acc in accumulators])
    assert any(isinstance(v, np.ndarray) for v in accumulators[0].row_arrays().values())
    assert with_arrays.schema == with_lists.schema
    assert with_arrays.equals(with_lists)


def test_a_payload_check_is_computed_piece_by_piece_as_the_kernel_adds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`HeadAccumulator.add` with a chunk's `PayloadCheck`: the CRC, taken piece by piece as the
    kernel reads (rows over several kernel pieces), passes for the payload's own CRC (the sums
    then equal those of an add without a check) and raises `ChecksumError` for any other, on the
    compiled and the numpy path."""
    from kvformat.checksum import crc32c
    from kvformat.pages import PayloadCheck
    from kvsnap.analysis.engine.accumulator import HeadAccumulator
    from kvsnap.analysis.kernels import arrays, kernel

    rows = np.random.default_rng(3).standard_normal((2 * arrays.KERNEL_ROWS + 77, 16)).astype(np.float32)
    positions = np.arange(rows.shape[0])
    crc = crc32c(rows.reshape(-1).view(np.uint8).data)
    for compiled in (True, False) if kernel.AVAILABLE else (False,):  # C where built
        monkeypatch.setattr(kernel, "AVAILABLE", compiled)
        checked, plain = HeadAccumulator(16), HeadAccumulator(16)
        checked.add(rows, positions, PayloadCheck(crc, "chunk 7 (layer 0 K)"))
        plain.add(rows, positions)
        np.testing.assert_array_equal(checked.power, plain.power)
        np.testing.assert_array_equal(checked.gram, plain.gram)
        assert checked.count == rows.shape[0]
        for wrong in (crc ^ 1, 0):
            with pytest.raises(kvformat.ChecksumError, match="chunk 7"):
                HeadAccumulator(16).add(rows, positions, PayloadCheck(wrong, "chunk 7 (layer 0 K)"))


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the error alone, no warnings about the garbage
@pytest.mark.parametrize("tensor", ["k", "v"])
@pytest.mark.parametrize("keys", ["post_rope", "pre_rope"])
@pytest.mark.parametrize("jobs", [1, 2])
def test_a_damaged_byte_in_a_late_piece_of_a_large_chunk_stops_the_pass(
    tmp_path: Path, tensor: str, keys: str, jobs: int
) -> None:
    """Whole raw chunks are read unchecked and checksummed as the kernel adds them: a byte
    flipped near the end of a K or V chunk (past the first kernel piece) still stops the pass
    with the chunk's name, on one worker and on threads, with post- and pre-RoPE keys (K is
    checked before it is rotated back)."""
    path = tmp_path / "big.kv"
    random_file(path, heads=2, tokens=9000, metadata=ROPE, chunk_bytes=16 << 20)
    with kvformat.open(path) as snap:
        segment = snap.segments()[1]
        chunk = segment.k_chunk if tensor == "k" else segment.v_chunk
        assert snap._file.chunk(chunk).rows == 9000  # one chunk holds the head's rows
        table = snap._file.table
        offset = int(table["offset"][chunk]) + int(table["stored_size"][chunk]) - 5
    raw = bytearray(path.read_bytes())
    raw[offset + 64] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(kvformat.ChecksumError, match=f"chunk {chunk} .*payload CRC-32C"):
        stats_rows(path, jobs=jobs, keys=keys)


@pytest.mark.parametrize("size", [1, 2, 7, 128, 129])
def test_the_small_median_equals_numpy(size: int) -> None:
    """`outlier_channel_ratio`'s median (a sort per stacked row instead of ``np.median``): the
    same value, NaN for NaN input."""
    from kvsnap.analysis.engine.rows import medians

    rng = np.random.default_rng(size)
    values = np.abs(rng.standard_normal((3, size))) * 10.0 ** rng.integers(-3, 3, (3, size))
    assert medians(values).tolist() == np.median(values, axis=-1).tolist()
    values[1, size // 2] = np.nan
    got = medians(values)
    assert np.isnan(got[1]) and got[0] == np.median(values[0]) and got[2] == np.median(values[2])


@pytest.mark.parametrize("groups", ["all", "norms", "channels,rope", "spectrum", "quant", "norms,spectrum"])
def test_rows_computed_in_a_stack_equal_rows_computed_alone(groups: str) -> None:
    """`rows.compute` stacks the accumulators of one dim and groups; each row equals, bit for
    bit, the row the accumulator computes alone (also empty ones, and NaN channels)."""
    from kvsnap.analysis.engine import rows
    from kvsnap.analysis.stats.rope import Rope

    rng = np.random.default_rng(4)
    dim = 64
    rope = Rope(10000.0, dim, "half")
    made = []
    for i in range(7):
        acc = HeadAccumulator(dim, rope, stat_groups(groups))
        if i != 3:  # one accumulator holds no rows
            count = 300 + 97 * i
            x = (rng.standard_normal((count, dim)) * rng.uniform(0.1, 9, dim)).astype(np.float32)
            if i == 5:
                x[:, 7] = 0.0  # a channel without variance
            acc.add(x, np.arange(count) + 13 * i)
        made.append(acc)
    alone = [acc.row_arrays() for acc in made]
    for acc in made:
        acc.computed_row = None
    rows.compute(made)
    for expected, acc in zip(alone, made, strict=True):
        got = acc.row_arrays()
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)


def test_without_the_c_kernels_the_numpy_reference_gives_the_table_and_stats_says_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the C kernels are not built, a ``"cpu"`` pass runs on the numpy reference and gives
    the compiled kernel's table; ``kvsnap stats`` says once, on stderr, that the compiled kernels
    are missing and how to get them. With them built it says nothing."""
    from kvsnap.analysis import kernels as backends
    from kvsnap.analysis.engine.batch import head_stats
    from kvsnap.analysis.kernels import kernel, native
    from kvsnap.cli import main

    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((2, 40, 16)).astype(np.float32) for _ in range(2))
    path = tmp_path / "small.kv"
    kvformat.save(path, [kvformat.Layer(k, v), kvformat.Layer(v, k)])
    compiled = head_stats(path, jobs=1)
    main(["stats", str(path), "--jobs", "1"])
    assert "compiled kernels" not in capsys.readouterr().err
    monkeypatch.setattr(native, "REQUESTED", True)  # (the default: no KVSNAP_KERNEL=numpy)
    monkeypatch.setattr(native, "AVAILABLE", False)
    monkeypatch.setattr(kernel, "AVAILABLE", False)
    assert backends.of("cpu").NAME == "numpy"
    small = head_stats(path, jobs=1)
    assert small.columns == compiled.columns and small.height == compiled.height
    for column in compiled.columns:
        if compiled[column].dtype.is_float():
            np.testing.assert_allclose(small[column], compiled[column], rtol=1e-5, atol=1e-9, err_msg=column)
        elif compiled[column].dtype.is_numeric() or compiled[column].dtype == pl.String:
            assert small[column].to_list() == compiled[column].to_list(), column
    main(["stats", str(path), "--jobs", "1"])
    err = capsys.readouterr().err
    assert err.count("compiled kernels are not built") == 1, err
    assert "reinstall kvsnap" in err
    monkeypatch.setenv("KVSNAP_KERNEL", "numpy")
    monkeypatch.setattr(native, "REQUESTED", False)
    main(["stats", str(path), "--jobs", "1"])
    assert "compiled kernels" not in capsys.readouterr().err  # the reference asked for


def test_every_sum_of_an_accumulator_is_declared_once_in_the_catalogue() -> None:
    """`catalogue.SUMS` names every sum a `HeadAccumulator` keeps (each once, with a known merge
    rule and groups), and merging follows each declared rule."""
    from dataclasses import fields

    from kvsnap.analysis.engine.accumulator import HeadAccumulator
    from kvsnap.analysis.stats.catalogue import GROUPS, SUMS

    names = [total.name for total in SUMS]
    assert len(names) == len(set(names))
    state = {
        "dim",
        "rope",
        "groups",
        "backend",
        "pending",
        "computed_row",
        "layout",
        "slot",
        "_sealed",
        "added",
    }
    assert {f.name for f in fields(HeadAccumulator)} - state == set(names)
    for total in SUMS:
        assert total.merge in ("add", "min", "max", "top") and total.groups <= set(GROUPS), total
    rng = np.random.default_rng(5)
    a, b, both = HeadAccumulator(8), HeadAccumulator(8), HeadAccumulator(8)
    rows = rng.standard_normal((30, 8)).astype(np.float32) * 3
    a.add(rows[:12], np.arange(12))
    b.add(rows[12:], np.arange(12, 30))
    both.add(rows, np.arange(30))
    quant = {name: getattr(a, name) + getattr(b, name) for name in ("quant_token", "quant_channel")}
    a.merge(b)
    for total in SUMS:
        mine, whole = getattr(a, total.name), getattr(both, total.name)
        if total.name in quant:  # groups of 32 tokens: a split file's groups are its own; they add
            np.testing.assert_array_equal(mine, quant[total.name])
        elif total.merge == "top":
            assert mine == whole
        else:
            np.testing.assert_allclose(np.asarray(mine, np.float64), np.asarray(whole, np.float64), rtol=1e-6)


def test_a_file_table_built_at_once_equals_its_layer_tables_concatenated(tmp_path: Path) -> None:
    """`file_table` without a sink builds one table of every layer's rows at the end (one Arrow
    build per file); it equals the per-layer tables `stats_for_file` yields, concatenated, for a
    file whose layers differ: head dims, an absent layer, a one-token layer, RoPE on some."""
    import pyarrow as pa

    from kvsnap.analysis.engine.plan import PassOptions
    from kvsnap.analysis.engine.tables import file_table, layer_tables

    rng = np.random.default_rng(4)

    def layer(heads: int, tokens: int, dim: int) -> kvformat.Layer:
        k = rng.standard_normal((heads, tokens, dim)).astype(np.float32)
        return kvformat.Layer(k, rng.standard_normal((heads, tokens, dim // 2)).astype(np.float32))

    path = tmp_path / "mixed.kv"
    kvformat.save(
        path,
        [layer(2, 50, 8), None, layer(3, 1, 40), layer(1, 70, 16)],
        metadata={"rope": {"base": 10000.0, "pairing": "half"}},
    )
    for options in (PassOptions(), PassOptions(stats="norms,spectrum"), PassOptions(part=(1, 2))):
        at_once = file_table(path, options)
        by_layer = list(layer_tables(path, options))
        assert at_once.num_rows > 0
        expected = pa.concat_tables(by_layer, promote_options="default")
        assert at_once.schema == expected.schema, options
        assert pl.from_arrow(at_once).equals(pl.from_arrow(expected)), options  # NaN equals NaN there
