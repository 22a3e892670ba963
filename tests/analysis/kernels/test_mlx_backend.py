"""``backend="mlx"``: the statistics as mlx array operations on mlx's default device
(CPU mlx here; Metal or CUDA where the user has them) equal the CPU kernel's table within
`mlx_backend.TOLERANCES`, for every column and statistic group, on random K/V (massive rows,
float32/float16/bfloat16, head dims that are not a multiple of the quantization group, pieces
under and over the float32-Gram threshold and over one piece) and on real captured K/V."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import kvformat
from kvsnap.analysis.engine.batch import merged_stats, run_stats
from kvsnap.analysis.engine.tables import stats_rows
from kvsnap.analysis.kernels import mlx as mlx_backend
from kvsnap.analysis.kernels import mlx_fold, mlx_pipeline, mlx_sizing, mlx_staging
from kvsnap.analysis.stats import GROUPS
from kvsnap.cli import main
from tests import factories

QUANTILES = {"norm_p50", "norm_p99"}


def random_file(path: Path, dtype: Any, dim: int, tokens: int, seed: int = 0) -> Path:
    """Two layers of two heads: scaled channels, an attention sink, a massive value, RoPE."""
    made = factories.random_file(
        path,
        layers=2,
        tokens=tokens,
        dim=dim,
        seed=seed,
        dtype=dtype,
        channel_scales="random",
        sink=40.0,
        massive=300.0,
        v_shift=0.3,
        rope=True,
    )
    return made.path


def within(got: np.ndarray, expected: np.ndarray, tolerance: np.ndarray) -> bool:
    """``|got - expected| <= tolerance`` elementwise, NaN equal to NaN (an empty channel)."""
    both_nan = np.isnan(got) & np.isnan(expected)
    return bool(np.all(both_nan | (np.abs(got - expected) <= tolerance)))


def assert_close(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> float:
    """Every column of every row within the documented tolerances; returns the worst relative
    error seen outside the quantiles."""
    assert len(got) == len(expected) > 0
    worst = 0.0
    default = mlx_backend.TOLERANCES["default"]
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys()
        where = f"layer {b['layer']} head {b['head']} {b['tensor']}"
        for name, value in b.items():
            if name in ("file", "layer", "head", "seq", "tensor", "snapshot", "n_tokens"):
                assert a[name] == value, name
                continue
            if name == "massive_positions":
                assert set(a[name]) == set(value), (name, where)
                continue
            other, value = np.asarray(a[name], float), np.asarray(value, float)
            if name == "eigenvalues":  # relative to the largest: small ones are float32 noise
                other, value = other[:16], value[:16]
                np.testing.assert_allclose(other, value, rtol=0, atol=default * value.max(), err_msg=where)
                continue
            if name in QUANTILES:
                np.testing.assert_allclose(
                    other, value, rtol=mlx_backend.TOLERANCES["quantile"], err_msg=where
                )
                continue
            if name == "channel_mean":  # relative to the channel's spread: means near zero
                spread = np.sqrt(np.asarray(b["channel_var"], float))
                assert within(other, value, default * spread + 1e-12), (name, where)
                continue
            if name == "channel_kurtosis":  # relative to the kurtosis, not the excess near zero
                assert within(other, value, default * np.abs(value + 3)), (name, where)
                continue
            np.testing.assert_allclose(other, value, rtol=default, atol=1e-9, err_msg=f"{name} {where}")
            finite = np.isfinite(value) & (np.abs(value) > 1e-6)
            if finite.any():
                worst = max(
                    worst, float(np.max(np.abs(other[finite] - value[finite]) / np.abs(value[finite])))
                )
    return worst


@pytest.mark.parametrize(
    "dtype,dim,tokens",
    [
        (np.float32, 64, 700),  # one piece, float32 Gram on the device
        (np.float16, 80, 300),  # under the threshold: the Gram on the host in float64
        (ml_dtypes.bfloat16, 64, 9000),  # two pieces
    ],
    ids=["float32", "float16-dim80", "bfloat16-two-pieces"],
)
def test_random_files_match_the_cpu_kernel(tmp_path: Path, dtype: Any, dim: int, tokens: int) -> None:
    path = random_file(tmp_path / "r.kv", dtype, dim, tokens)
    worst = assert_close(stats_rows(path, backend="mlx"), stats_rows(path))
    print(f"{mlx_backend.device_name()}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_each_group_alone(tmp_path: Path, group: str) -> None:
    path = random_file(tmp_path / "r.kv", np.float32, 64, 600, seed=1)
    got = stats_rows(path, stats=group, backend="mlx")
    assert_close(got, stats_rows(path, stats=group))
    keys = {
        "file",
        "layer",
        "head",
        "seq",
        "tensor",
        "snapshot",
        "n_tokens",
        "nonfinite_rows",
        "nonfinite_values",
    }
    assert set(got[0]) - keys == set(GROUPS[group])


@pytest.mark.network
def test_real_captures_match(real_capture: Path) -> None:
    worst = assert_close(stats_rows(real_capture, backend="mlx"), stats_rows(real_capture))
    print(f"real capture: worst relative error {worst:.2e}")


def test_many_files_and_merge(tmp_path: Path) -> None:
    paths = [str(random_file(tmp_path / f"{i}.kv", np.float32, 64, 520, seed=i)) for i in range(3)]
    got = merged_stats(paths, backend="mlx")
    expected = merged_stats(paths)
    assert not got.failures and got.files == 3
    order = ("layer", "head", "tensor")
    assert_close(got.table.sort(order).to_dicts(), expected.table.sort(order).to_dicts())
    many = run_stats(paths, backend="mlx")
    assert_close(many.table.to_dicts(), run_stats(paths).table.to_dicts())


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = random_file(tmp_path / "r.kv", np.float32, 64, 100)
    assert main(["stats", str(path), "--backend", "mlx", "-o", str(tmp_path / "t.parquet")]) == 0
    assert "mean ||K||" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # argparse: one usage line, exit status 2
        main(["stats", str(path), "--backend", "cuda"])
    assert exit_info.value.code == 2 and "--backend" in capsys.readouterr().err


def test_a_one_shot_command_keeps_a_small_file_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvsnap stats FILE --backend mlx` without ``--jobs`` passes ``jobs=1`` for one local file
    under `processes.MLX_ONE_SHOT_BYTES` (workers cost more to start than they save in one
    pass); ``--jobs``, several files, the CPU backend and a larger file keep the default."""
    from kvsnap.analysis.engine import batch, processes

    path = str(random_file(tmp_path / "r.kv", np.float32, 64, 100))
    other = str(random_file(tmp_path / "s.kv", np.float32, 64, 100, seed=1))
    asked: list[int | None] = []
    real = batch.run_stats

    def recording(files: Any, **options: Any) -> Any:
        asked.append(options.get("jobs"))
        return real(files, **options)

    monkeypatch.setattr(batch, "run_stats", recording)
    out = ["-o", str(tmp_path / "t.parquet"), "--force"]
    assert main(["stats", path, "--backend", "mlx", *out]) == 0
    assert main(["stats", path, "--backend", "mlx", "--jobs", "4", *out]) == 0
    assert main(["stats", path, other, "--backend", "mlx", *out]) == 0
    assert main(["stats", path, *out]) == 0
    monkeypatch.setattr(processes, "MLX_ONE_SHOT_BYTES", 100)  # the file is larger than this
    assert main(["stats", path, "--backend", "mlx", *out]) == 0
    assert asked == [1, 4, None, None, None]
    assert not processes.one_shot_in_process(str(tmp_path / "*.kv"))  # a pattern is not a file
    assert not processes.one_shot_in_process("https://example.com/a.kv")


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_staging_buffers_carry_the_rows_and_are_reused(dtype: Any) -> None:
    """Pieces copied into a device buffer through its memory are what the device reads, in
    every stored type; a buffer given back is reused (and overwritten) by the next batch."""
    import mlx.core as mx

    from kvsnap.analysis.kernels.mlx_staging import Staging

    staging = Staging.create()
    assert staging is not None  # CPU mlx exposes its memory: the fast path is what CI tests
    rng = np.random.default_rng(4)
    try:
        for round_ in range(2):
            pieces = [rng.standard_normal((300, 24)).astype(dtype) for _ in range(3)]
            buffer, stacked = staging.fill(pieces)
            expected = np.stack([p.astype(np.float32) for p in pieces])
            np.testing.assert_array_equal(np.array(stacked.astype(mx.float32)), expected)
            if round_ == 0:
                first = buffer
                staging.give_back([buffer])
            else:
                assert buffer is first  # the same device memory, new rows
    finally:
        staging.close()


def test_staged_and_copied_batches_give_the_same_sums(tmp_path: Path) -> None:
    from kvsnap.analysis.engine import accumulator
    from kvsnap.analysis.kernels import mlx_pipeline

    path = random_file(tmp_path / "r.kv", ml_dtypes.bfloat16, 64, 3000)
    rows = []
    for staging in (True, False):
        accs = []
        with kvformat.open(path) as snap, mlx_pipeline.Pipeline(limit=1 << 20, staging=staging) as pipeline:
            assert (pipeline._staging is not None) is staging
            for block in snap.blocks():
                acc = accumulator.HeadAccumulator(64, backend="mlx")
                pipeline.add(acc, block.k, block.positions)
                accs.append(acc)
            pipeline.finish()
            rows.append([acc.row() for acc in accs])
    for staged, copied in zip(*rows, strict=True):
        for name, value in copied.items():
            np.testing.assert_array_equal(np.asarray(staged[name]), np.asarray(value), err_msg=name)


def test_a_pass_holds_two_batches_of_staging_buffers_and_one_of_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many batches of one shape: a batch's copies start only after the batch before it has
    been launched (its pages released) and the one before that fetched (its buffers given
    back), so at most two batches' buffers and one batch's unreleased pages exist at a time;
    the sums are the unstaged pipeline's."""
    from kvsnap.analysis.engine import accumulator

    live: list[int] = []
    taken: list[int] = []
    unreleased: list[int] = []
    pages: list[int] = []
    original_take, original_back = mlx_staging.Staging._take, mlx_staging.Staging.give_back

    def take(self: mlx_staging.Staging, shape: tuple[int, ...], dtype: Any) -> Any:
        live.append(1)
        taken.append(len(live))
        pages.append(len(unreleased))  # batches copied but not released when this one starts
        unreleased.append(1)
        return original_take(self, shape, dtype)

    def give_back(self: mlx_staging.Staging, buffers: list[Any]) -> None:
        del live[: len(buffers)]
        original_back(self, buffers)

    monkeypatch.setattr(mlx_staging.Staging, "_take", take)
    monkeypatch.setattr(mlx_staging.Staging, "give_back", give_back)
    rng = np.random.default_rng(3)
    pieces = [rng.standard_normal((512, 32)).astype(np.float32) for _ in range(24)]
    sums = []
    for staging in (True, False):
        accs = []
        # two pieces a batch: the limit counts 16-bit values (float32 rows batch as many values)
        with mlx_pipeline.Pipeline(limit=2 * 2 * pieces[0].size, staging=staging) as pipeline:
            for i, x in enumerate(pieces):
                acc = accumulator.HeadAccumulator(32, backend="mlx")
                after = (lambda: unreleased.pop()) if i % 2 else None  # a batch's last piece
                pipeline.add(acc, x, np.arange(len(x)), after=after if staging else None)
                accs.append(acc)
            pipeline.finish()
        sums.append([acc.norm_sq_sum for acc in accs])
    assert len(taken) == 12 and max(taken) == 2 and max(pages) == 0 and not unreleased
    assert sums[0] == sums[1]


def test_the_pipeline_checks_finiteness_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driving thread never scans rows for inf or NaN (`mlx_fold.fold_checked`): a piece
    whose device sum of squares is finite is folded as it is; one holding a NaN, and one whose
    finite values square beyond float32's range, are added on the host in float64 instead, the
    NaN's row left out and counted, the huge row kept, as the CPU kernel does."""
    from kvsnap.analysis.stats import finite

    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 3, 700, 64)).astype(np.float32)
    v = rng.standard_normal((2, 3, 700, 64)).astype(np.float32)
    k[0, 1, 5, 3] = np.nan  # layer 0 head 1 K: one row left out
    v[1, 2, 9] = 1e30  # layer 1 head 2 V: a finite row whose squares overflow float32
    path = tmp_path / "r.kv"
    kvformat.save(path, [kvformat.Layer(k[i], v[i]) for i in range(2)])

    import threading

    real_scan = finite.any_nonfinite

    def scanned(rows: np.ndarray) -> bool:
        assert threading.current_thread() is not threading.main_thread(), "the driving thread scanned rows"
        return real_scan(rows)

    folded: list[int] = []
    real = mlx_fold.fold_group
    monkeypatch.setattr(
        mlx_fold, "fold_group", lambda entries, out: (folded.append(len(entries)), real(entries, out))
    )
    monkeypatch.setattr(finite, "any_nonfinite", scanned)
    got = stats_rows(path, backend="mlx")
    monkeypatch.undo()
    expected = stats_rows(path)
    assert sum(folded) == 2 * 2 * 3 - 2  # every piece but the two from the device
    assert_close(got, expected)
    by_key = {(r["layer"], r["head"], r["tensor"]): r for r in got}
    assert by_key[(0, 1, "k")]["nonfinite_rows"] == 1 and by_key[(0, 1, "k")]["n_tokens"] == 699
    assert by_key[(1, 2, "v")]["nonfinite_rows"] == 0 and by_key[(1, 2, "v")]["n_tokens"] == 700
    assert by_key[(1, 2, "v")]["norm_max"] == pytest.approx(1e30 * 8, rel=1e-6)


def test_a_corrupt_chunk_stops_the_mlx_pass_with_its_error(tmp_path: Path) -> None:
    """A checksum error on a reader thread reaches the caller (no hang, no partial table)."""
    path = random_file(tmp_path / "r.kv", np.float32, 64, 500)
    with kvformat.open(path) as snap:
        offset = int(snap._file.table["offset"][5]) + 64 + 100  # inside chunk 5's payload
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(kvformat.ChecksumError, match="chunk 5"):
        stats_rows(path, backend="mlx")


def test_positions_with_gaps_fold_like_the_cpu_kernel(tmp_path: Path) -> None:
    """A sliding window that kept its first tokens: positions 0..3 then 5000..5699 (the bins of
    gapped positions are computed per piece, those of runs once per layer)."""
    rng = np.random.default_rng(8)
    positions = np.concatenate([np.arange(4), np.arange(5000, 5700)])
    k = rng.standard_normal((2, positions.size, 32)).astype(np.float32)
    path = tmp_path / "window.kv"
    kvformat.save(
        path, [kvformat.Layer(k, k * 0.5, positions), kvformat.Layer(k[:, 4:], k[:, 4:], positions[4:])]
    )
    got, expected = stats_rows(path, backend="mlx"), stats_rows(path)
    assert_close(got, expected)
    assert [len(row["norm_by_position"]) for row in got] == [len(row["norm_by_position"]) for row in expected]
    assert got[0]["norm_by_position"][1] == pytest.approx(expected[0]["norm_by_position"][1], rel=1e-5)


def test_device_histogram_bins_equal_the_hosts_at_the_bin_edges() -> None:
    """The device picks each row's norm and peak histogram bin in float32, then corrects it
    against exact edges: on values at and around every sampled edge, its bins are the ones
    `catalogue.hist_index` gives in float64 (what the CPU path and the old host fold counted)."""
    import mlx.core as mx

    from kvsnap.analysis.stats.catalogue import hist_index

    rng = np.random.default_rng(0)
    edges = mlx_backend.device_hist_edges(squared=True)[1:-1]
    picked = np.sqrt(edges[rng.choice(edges.size, 400, replace=False)].astype(np.float64)).astype(np.float32)
    values = np.concatenate(
        [
            picked,
            np.nextafter(picked, np.float32(0)),
            np.nextafter(picked, np.float32(np.inf)),
            [0, 1e-30, 1e18],
        ]
    ).astype(np.float32)
    rows = np.zeros((values.size, 4), np.float32)
    rows[:, 0] = values  # one non-zero channel: the squared norm is values**2 in float32, exactly
    function = mlx_backend.piece_function(True, True, False, False, False, False)
    out = function(mx.array(rows), mx.array(np.zeros(values.size, np.uint8)))
    square = values.astype(np.float32) * values.astype(np.float32)
    expected_norm_bins = hist_index(np.sqrt(square.astype(np.float64)))
    expected_peak_bins = hist_index(values.astype(np.float64))
    bins = mlx_backend.device_hist_edges(squared=False).size - 1
    assert np.array_equal(np.array(out["norm_hist"]), np.bincount(expected_norm_bins, minlength=bins))
    assert np.array_equal(np.array(out["peak_hist"]), np.bincount(expected_peak_bins, minlength=bins))
    assert len(set(expected_norm_bins.tolist())) > 300  # many bins, each around its edge
    # Not finite: bin 0, as the host's and the CPU kernel's bins (and never out of range).
    odd = np.zeros((3, 4), np.float32)
    odd[:, 0] = [np.inf, np.nan, -np.inf]
    out = function(mx.array(odd), mx.array(np.zeros(3, np.uint8)))
    assert np.array(out["norm_hist"])[0] == np.array(out["peak_hist"])[0] == 3


def test_massive_rows_go_to_the_host_by_the_median() -> None:
    """The piece's heavy rows (squared norm over `HEAVY` times the median) are the CPU kernel's
    (`kernel.heavy_rows` on `np.median`), and the device's Gram plus theirs is the whole Gram."""
    import mlx.core as mx

    from kvsnap.analysis.kernels import kernel
    from kvsnap.analysis.kernels.arrays import HEAVY

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((2048, 32)).astype(np.float32)
    rows[[5, 700, 701]] *= 50.0  # massive rows
    rows[900] *= 3.9  # large (15x its squared norm), but under 16x the median: light
    function = mlx_backend.piece_function(False, False, False, False, True, False)
    out = mlx_fold.to_host(function(mx.array(rows)))
    square = (rows.astype(np.float64) ** 2).sum(axis=1)
    heavy = kernel.heavy_rows(square, HEAVY)
    assert heavy.sum() == 3 and int(out["heavy"]) == 3
    assert np.array_equal(out["light"] == 0, heavy)
    big = rows[heavy].astype(np.float64)
    light = rows[~heavy].astype(np.float64)
    center = out["center"].astype(np.float64)
    shifted_gram = (light - center).T @ (light - center)
    assert np.abs(out["product"] - shifted_gram).max() <= 2e-5 * np.abs(shifted_gram).max()
    sums = out["light_sums"].astype(np.float64)
    outer = np.outer(center, sums) + np.outer(sums, center) - light.shape[0] * np.outer(center, center)
    whole = rows.astype(np.float64).T @ rows.astype(np.float64)
    assert np.abs(out["product"] + outer + big.T @ big - whole).max() <= 2e-5 * np.abs(whole).max()


@pytest.mark.parametrize("k_ties", [0, 1, 3, 8, 12])
def test_device_top_peaks_break_ties_as_the_cpu_kernel(k_ties: int) -> None:
    """The device's top rows (`top_rows` on the device, `_top_found` on the host) are the CPU
    kernel's (`kernel.top_rows`): the largest peaks, among equal ones the later rows, with runs
    of equal peaks straddling the k-th place, NaN and inf."""
    import mlx.core as mx

    from kvsnap.analysis.kernels import kernel
    from kvsnap.analysis.stats.catalogue import TOP_K

    rng = np.random.default_rng(k_ties)
    n = 500
    peaks = rng.random(n).astype(np.float32)
    tied = rng.choice(n, size=k_ties, replace=False)
    peaks[tied] = np.float32(2.0)  # equal peaks, some of them in the top k
    peaks[rng.choice(n, size=3, replace=False)] = np.float32(3.0)
    if k_ties >= 8:
        peaks[7], peaks[400] = np.inf, np.nan
    rows = np.zeros((n, 4), np.float32)
    rows[:, 1] = -peaks  # the peak is the largest magnitude of a row
    function = mlx_backend.piece_function(False, True, False, True, False, False)
    out = mlx_fold.to_host(function(mx.array(rows)))
    positions = np.arange(n) * 3
    found = mlx_fold.top_found(out["top_rows"].tolist(), out["top_peaks"].tolist(), positions)
    bits = np.abs(rows).max(axis=1).view(np.int32)
    expected = kernel.top_rows(bits, TOP_K)
    assert sorted(int(p) // 3 for _, p in found) == sorted(expected.tolist())
    assert len(found) == TOP_K
    for peak, position in found:
        assert np.array_equal(np.float32(peak), np.abs(rows[position // 3]).max(), equal_nan=True)


def test_copy_threads_check_the_payload_crcs_of_what_they_copy() -> None:
    """`Staging.start_fill` with checks: each piece's CRC is combined from its copy tasks' (several
    per piece here) and held against the expected one; a wrong one raises with the chunk's name."""
    from kvformat.checksum import crc32c
    from kvformat.pages import PayloadCheck
    from kvsnap.analysis.kernels.mlx_staging import Staging

    probe = Staging.create()
    assert probe is not None  # CPU mlx exposes its memory: the copy threads are used
    probe.close()
    staging = Staging(4)  # whatever this machine's cores: several copy tasks per piece
    rng = np.random.default_rng(8)
    try:
        for dtype in (np.float32, ml_dtypes.bfloat16):
            pieces = [rng.standard_normal((300, 24)).astype(dtype) for _ in range(2)]
            checks = [PayloadCheck(crc32c(p.tobytes()), f"chunk {i}") for i, p in enumerate(pieces)]
            fill = staging.start_fill(pieces, checks)
            assert len(fill.copies) > len(pieces)  # a piece is copied (and checksummed) in parts
            buffer, _ = fill.result()
            staging.give_back([buffer])
            wrong = [checks[0], PayloadCheck(checks[1].crc ^ 1, "chunk 1")]
            with pytest.raises(kvformat.ChecksumError, match="chunk 1: payload CRC-32C mismatch"):
                staging.start_fill(pieces, wrong).result()
            unchecked = staging.start_fill(pieces, [None, None])
            unchecked.result()
    finally:
        staging.close()


@pytest.mark.parametrize("tensor", ["k", "v"])
def test_a_corrupt_chunk_is_found_by_the_copy_threads(tmp_path: Path, tensor: str) -> None:
    """Chunks read unchecked (`Pages.read_unchecked`) are checked on the copy threads: a
    damaged K or V chunk stops the pass with its name, as the CPU pass does."""
    path = random_file(tmp_path / "r.kv", ml_dtypes.bfloat16, 64, 700)
    with kvformat.open(path) as snap:
        table = snap._file.table
        chunk = int(np.flatnonzero(table["kind"] == (0 if tensor == "k" else 1))[3])
        offset = int(table["offset"][chunk]) + 64 + 37
        _, k_check, v_check = kvformat.pages.of(snap).read_unchecked(snap.segments()[0])
        assert k_check is not None and v_check is not None  # whole raw chunks: left to the caller
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    for backend in ("mlx", "cpu"):
        with pytest.raises(kvformat.ChecksumError, match=f"chunk {chunk} .*payload CRC-32C mismatch"):
            stats_rows(path, backend=backend)


def _piece_accumulators(count: int, rows: int = 700, dim: int = 32) -> list[tuple[Any, np.ndarray]]:
    from kvsnap.analysis.engine import accumulator

    rng = np.random.default_rng(3)
    return [
        (accumulator.HeadAccumulator(dim, backend="mlx"), rng.standard_normal((rows, dim)).astype(np.float32))
        for _ in range(count)
    ]


def test_a_mark_is_done_once_what_came_before_it_is_folded() -> None:
    """`Pipeline.mark` waits for nothing: the pieces added before it are folded when it is done
    (its accumulators' sums complete), the pieces added after it need not be."""
    with mlx_pipeline.Pipeline(limit=50 << 10) as pipeline:  # two pieces a batch
        assert pipeline.mark().result(timeout=0) is None  # nothing added: done at once
        first = _piece_accumulators(4)
        for acc, x in first:
            pipeline.add(acc, x, np.arange(len(x)))
        mark = pipeline.mark()
        later = _piece_accumulators(6)
        for acc, x in later:
            pipeline.add(acc, x, np.arange(len(x)))
        mark.result(timeout=60)
        for acc, x in first:
            assert acc.pending is None and acc.count == len(x)
            expected = np.square(x.astype(np.float64)).sum()
            assert acc.norm_sq_sum == pytest.approx(expected, rel=1e-5)
        pipeline.finish()
        again = pipeline.mark()  # everything folded: done at once
        assert again.done() and all(acc.count == len(x) for acc, x in later)


def test_an_abandoned_pipeline_fails_its_marks() -> None:
    """A mark whose work the pipeline drops (after a failure elsewhere) raises, never hangs."""
    pipeline = mlx_pipeline.Pipeline(limit=1 << 30)  # nothing is sent until `finish`
    for acc, x in _piece_accumulators(2):
        pipeline.add(acc, x, np.arange(len(x)))
    mark = pipeline.mark()
    assert not mark.done()
    pipeline.abandon()
    with pytest.raises(mlx_pipeline.PipelineAbandoned):
        mark.result(timeout=10)


def test_a_failed_fold_reaches_the_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> None:
        raise ValueError("fold failed")

    monkeypatch.setattr(mlx_fold, "fold_group", broken)
    pipeline = mlx_pipeline.Pipeline(limit=1 << 30)
    for acc, x in _piece_accumulators(2):
        pipeline.add(acc, x, np.arange(len(x)))
    mark = pipeline.mark()
    with pytest.raises(ValueError, match="fold failed"):
        pipeline.finish()
    with pytest.raises(ValueError, match="fold failed"):
        mark.result(timeout=10)
    pipeline.abandon()


def test_an_mlx_pass_does_not_drain_the_device_at_each_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process the pass marks each layer's end (`Pipeline.mark`) and drains the pipeline
    once, at the end; the table is the CPU kernel's."""
    path = factories.random_file(tmp_path / "four.kv", layers=4, tokens=300, dim=32, seed=5).path
    finishes = []
    original = mlx_pipeline.Pipeline.finish

    def counted(self: mlx_pipeline.Pipeline) -> None:
        finishes.append(1)
        original(self)

    monkeypatch.setattr(mlx_pipeline.Pipeline, "finish", counted)
    got = stats_rows(path, backend="mlx", jobs=1)
    assert len(finishes) == 2  # the pass's end and the pipeline's close
    assert_close(got, stats_rows(path, jobs=1))


@pytest.mark.parametrize(("layers", "runs"), [(4, 1), (2, 2), (1, 4)])
def test_an_mlx_pass_stacks_a_layers_rows_in_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layers: int, runs: int
) -> None:
    """With 4 row threads, a layer's rows are computed in one stacked run when the file has at
    least as many layers (fewer calls, each waiting for the interpreter's lock), cut into runs
    over the threads only when it has fewer; the table is the CPU kernel's either way."""
    from kvsnap.analysis.engine import streaming

    path = factories.random_file(tmp_path / "f.kv", layers=layers, heads=4, tokens=64, dim=16, seed=3).path
    monkeypatch.setattr(mlx_sizing, "row_threads", lambda share=1: 4)
    sizes: list[int] = []
    original = streaming.compute_rows

    def recorded(accumulators: list[Any]) -> None:
        sizes.append(len(accumulators))
        original(accumulators)

    monkeypatch.setattr(streaming, "compute_rows", recorded)
    got = stats_rows(path, backend="mlx", jobs=1)
    per_layer = 8  # 4 heads, K and V
    assert sorted(sizes) == sorted([-(-per_layer // runs)] * runs * layers)
    assert_close(got, stats_rows(path, jobs=1))


@pytest.mark.parametrize("closing", [0, 1])
def test_a_pass_that_waits_for_each_layer_drives_the_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closing: int
) -> None:
    """With at most ``closing`` layers left at work, the pass waits for a layer whose pieces are
    still queued (the batch is not full): `Pipeline.wait` sends and folds them, so the pass
    neither hangs nor drains at every layer, and the table is the CPU kernel's."""
    from kvsnap.analysis.engine import streaming

    monkeypatch.setattr(streaming, "CLOSING_LAYERS", closing)
    path = factories.random_file(tmp_path / "five.kv", layers=5, tokens=200, dim=32, seed=9).path
    waited = []
    original = mlx_pipeline.Pipeline.wait

    def counted(self: mlx_pipeline.Pipeline, mark: Any) -> None:
        waited.append(mark.done())
        original(self, mark)

    monkeypatch.setattr(mlx_pipeline.Pipeline, "wait", counted)
    got = stats_rows(path, backend="mlx", jobs=1)
    assert len(waited) == 5 and not all(waited)  # some marks were waited for before done
    assert_close(got, stats_rows(path, jobs=1))


@pytest.mark.parametrize("missing", ["mlx", "mlx.core"])
def test_backend_mlx_without_mlx_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    """mlx is looked for, not imported; where it is missing the pass stops before any work with a
    ValueError naming the install."""
    from kvsnap.analysis.kernels import check as check_backend

    monkeypatch.setitem(sys.modules, missing, None)
    if missing == "mlx":
        monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    with pytest.raises(ValueError, match="needs mlx: pip install"):
        check_backend("mlx")
    check_backend("cpu")


def _folded(order: list[int], stacked: bool, merged: int | None = None) -> list[Any]:
    """Four 128-channel accumulators (all groups, K with RoPE) given two batches of device
    results, entries in ``order`` (indices of accumulators; one twice: a head with two pieces in
    one batch), their sums stacked or not, accumulator ``merged`` merged into (its sums rebound)
    before the second batch."""
    import mlx.core as mx

    from kvsnap.analysis.engine.accumulator import HeadAccumulator, stack
    from kvsnap.analysis.kernels.arrays import GRAM_FLOAT64_ROWS
    from kvsnap.analysis.stats.rope import Rope

    rng = np.random.default_rng(3)
    n = GRAM_FLOAT64_ROWS * 2
    accs = [HeadAccumulator(128, Rope(10000.0, 128, "half"), backend="mlx") for _ in range(4)]
    if stacked:
        assert stack(accs) is not None
    function = mlx_backend.piece_function(True, True, True, True, True, True, batched=True)
    for batch in range(2):
        if batch == 1 and merged is not None:
            extra = HeadAccumulator(128, Rope(10000.0, 128, "half"))
            extra.add(rng.standard_normal((40, 128)).astype(np.float32), np.arange(40))
            accs[merged].merge(extra)
        rows = rng.standard_normal((len(order), n, 128)).astype(np.float32)
        rows[:, 5] *= 40  # a heavy row in each piece: the Gram adds it on the host first
        positions = [np.arange(n) + batch * n for _ in order]
        bins = np.stack([mlx_fold.piece_bins(p) for p in positions])
        out = mlx_fold.to_host(function(mx.array(rows), mx.array(bins)))
        entries = [(accs[i], rows[j], positions[j]) for j, i in enumerate(order)]
        mlx_fold.fold_group(entries, out)
    return accs


def _watch_shared_stack(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per group folded from now on: whether it found its accumulators stacked."""
    calls: list[bool] = []
    original = mlx_fold.shared_stack

    def watched(entries: Any) -> Any:
        found = original(entries)
        calls.append(found is not None)
        return found

    monkeypatch.setattr(mlx_fold, "shared_stack", watched)
    return calls


@pytest.mark.parametrize(
    ("order", "merged"),
    [([0, 1, 2, 3], None), ([1, 2], None), ([3, 0, 2], None), ([0, 1, 1, 2], None), ([0, 1, 2, 3], 2)],
)
def test_stacked_sums_fold_to_the_same_bits(
    order: list[int], merged: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accumulators whose sums share one layout (`accumulator.stack`) get a group's device
    results in one call per sum, bit for bit what one accumulator at a time gets: rows that
    follow each other (a slice), out of order (an index), a head twice in a group and an
    accumulator merged into meanwhile (those two fall back to one at a time)."""
    calls = _watch_shared_stack(monkeypatch)
    one_by_one = _folded(order, stacked=False, merged=merged)
    assert calls == [False, False]
    calls.clear()
    together = _folded(order, stacked=True, merged=merged)
    twice = len(set(order)) < len(order)
    assert calls == [not twice, not twice and merged is None]
    for a, b in zip(one_by_one, together, strict=True):
        for name in ("norm_hist", "peak_hist", "power", "absmax", "gram", "unit_sum", "position_norm"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        for name in ("quant_token", "quant_channel", "position_count", "band", "top"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert (a.count, a.norm_sum, a.norm_sq_sum, a.first_count) == (
            b.count,
            b.norm_sum,
            b.norm_sq_sum,
            b.first_count,
        )


@pytest.mark.parametrize("rope", [False, True])
def test_an_mlx_pass_folds_stacked_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rope: bool
) -> None:
    """A layer's accumulators of one dim are stacked, so a group of its pieces folds in one call
    per sum: K and V together (their rows follow each other), or K's apart from V's where K has
    RoPE bands (every other row); the table is the CPU kernel's."""
    path = factories.random_file(
        tmp_path / "f.kv", layers=1, heads=4, tokens=1200, dim=64, seed=8, rope=rope
    ).path
    calls = _watch_shared_stack(monkeypatch)
    got = stats_rows(path, backend="mlx", jobs=1)
    assert calls and all(calls)
    assert_close(got, stats_rows(path, jobs=1))


def test_batch_bytes_one_process_workers_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 MiB per device call in one process, 16 MiB in a worker process (host memory per
    process is what counts there); ``KVSNAP_MLX_BATCH_MIB`` sets both, and a bad value names it."""
    monkeypatch.delenv("KVSNAP_MLX_BATCH_MIB", raising=False)
    assert mlx_sizing.batch_bytes() == 32 << 20
    assert mlx_sizing.batch_bytes(worker=True) == 16 << 20
    with mlx_pipeline.Pipeline(staging=False) as pipeline:
        assert pipeline.limit == 32 << 20
    monkeypatch.setenv("KVSNAP_MLX_BATCH_MIB", "8")
    assert mlx_sizing.batch_bytes() == mlx_sizing.batch_bytes(worker=True) == 8 << 20
    for bad in ("0", "-4", "1.5", "lots", "5000"):
        monkeypatch.setenv("KVSNAP_MLX_BATCH_MIB", bad)
        with pytest.raises(ValueError, match="KVSNAP_MLX_BATCH_MIB"):
            mlx_sizing.batch_bytes()


def test_the_per_piece_function_stacks_nothing_on_the_device(tmp_path: Path) -> None:
    """The batched per-piece function of every group has no Concatenate in its graph (stacks
    and concatenations on CUDA run mlx's general copy kernels, whose code costs each process
    host memory) and its outputs join on the host into the shapes the fold takes."""
    import mlx.core as mx

    from kvsnap.analysis.kernels.arrays import PIECE
    from kvsnap.analysis.stats.catalogue import QUANT_BITS, QUANT_GROUP, TOP_K

    n = PIECE - 5  # whole groups of rows and a rest: the channel errors come in two parts
    rng = np.random.default_rng(2)
    rows = mx.array(rng.standard_normal((3, n, 64)).astype(np.float32))
    bins = mx.array(np.stack([mlx_fold.piece_bins(np.arange(n))] * 3))
    piece = mlx_backend._piece(True, True, True, True, True, True)
    outputs = mx.vmap(piece)(rows, bins)
    mx.export_to_dot(str(tmp_path / "graph.dot"), *outputs.values())
    graph = (tmp_path / "graph.dot").read_text()
    assert 'label ="Sum"' in graph and "Concatenate" not in graph
    assert "quant_channel:0:1" in outputs
    host = mlx_fold.join_results({name: np.array(value) for name, value in outputs.items()})
    assert not any(":" in name for name in host)
    assert host["central"].shape == (3, 4, 64)
    assert host["top_rows"].shape == host["top_peaks"].shape == (3, 2, TOP_K)
    assert host["quant_token"].shape == (3, len(QUANT_BITS))
    assert host["quant_channel"].shape == (3, len(QUANT_BITS), -(-n // QUANT_GROUP))
    one = mlx_fold.join_results({name: np.array(value[0]) for name, value in outputs.items()})
    for name, value in one.items():
        np.testing.assert_array_equal(value, host[name][0], err_msg=name)


def test_fused_and_plain_piece_functions_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVSNAP_MLX_COMPILE``: the piece function fused by ``mx.compile`` (1) and as plain
    operations (0, the default off Metal: no kernels compiled at run time) give the same
    outputs for every group, batched too; another value is refused by name."""
    import mlx.core as mx

    from kvsnap.analysis.kernels.arrays import PIECE

    rng = np.random.default_rng(5)
    rows = rng.standard_normal((2, PIECE - 3, 64)).astype(np.float32)
    rows[:, 7] *= 30.0
    bins = np.stack([mlx_fold.piece_bins(np.arange(PIECE - 3))] * 2)
    flags = (True, True, True, True, True, True)
    found = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("KVSNAP_MLX_COMPILE", setting)
        assert mlx_backend.compiles() is (setting == "1")
        function = mlx_backend.piece_function(*flags, batched=True)
        found[setting] = mlx_fold.to_host(function(mx.array(rows), mx.array(bins)))
    assert found["1"].keys() == found["0"].keys()
    for name in found["1"]:
        np.testing.assert_allclose(found["0"][name], found["1"][name], rtol=1e-5, atol=1e-5, err_msg=name)
    monkeypatch.delenv("KVSNAP_MLX_COMPILE")
    assert mlx_backend.compiles() is False  # CPU mlx here: plain operations
    monkeypatch.setenv("KVSNAP_MLX_COMPILE", "yes")
    with pytest.raises(ValueError, match="KVSNAP_MLX_COMPILE"):
        mlx_backend.compiles()
