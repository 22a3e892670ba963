"""The compiled kernel (C, `analysis.kernels.native`) and the numpy reference of HeadAccumulator.add, its
oracle, compute the same statistics, for every dtype, odd sizes (partial quantization groups), RoPE
pairings, positions with and without 0, and several adds in a row."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kvsnap.analysis.engine.accumulator import HeadAccumulator
from kvsnap.analysis.kernels import compiled as compiled_backend
from kvsnap.analysis.kernels import kernel
from kvsnap.analysis.kernels import reference as reference_backend
from kvsnap.analysis.stats.rope import Rope
from tests.analysis.kernels.test_kernels_oracle import assert_close_to_reference


def test_the_compiled_kernel_is_in_use() -> None:
    assert kernel.AVAILABLE  # the install builds the C kernels (a C compiler is there)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [8, 40, 128])
@pytest.mark.parametrize("pairing", [None, "interleaved", "half"])
def test_compiled_and_numpy_paths_agree(dtype: type, dim: int, pairing: str | None) -> None:
    rng = np.random.default_rng(dim)
    rope = Rope(base=10000.0, dims=dim, pairing=pairing) if pairing else None
    compiled, reference = HeadAccumulator(dim, rope), HeadAccumulator(dim, rope)
    start = 0
    for n in (1, 45, 33, 200):  # partial groups of tokens and channels, a one-row block
        scale = np.exp(rng.normal(0, 1.5, dim))
        rows = (rng.standard_normal((n, dim)) * scale).astype(dtype)
        rows[rng.integers(0, n), rng.integers(0, dim)] = 0  # ties and zeros
        positions = np.arange(start, start + n) if start or n > 1 else np.array([0])
        compiled_backend.add(compiled, rows, positions)
        reference_backend.add(reference, rows, positions)
        start += n + int(rng.integers(0, 300))  # gaps, as in sliding windows
    got, expected = compiled.row(), reference.row()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if value is None:
            assert got[name] is None, name
        elif name in ("massive_positions", "n_tokens", "rank_90"):
            assert got[name] == value, name
        else:
            assert_close_to_reference(name, got[name], value, name)
    np.testing.assert_array_equal(compiled.norm_hist, reference.norm_hist)
    np.testing.assert_array_equal(compiled.position_count, reference.position_count)
    assert compiled.first_count == reference.first_count == 1


def test_histogram_bins_without_a_logarithm_are_hist_index() -> None:
    """The kernel's log histogram of row norms (a guess from the float's top bits, stepped against
    exact edges) counts every norm where `catalogue.hist_index` puts it: at each edge's float32
    neighbours, over 20 decades, at 0, subnormals, the clamps at both ends and inf. A row holding
    one value ``v`` has norm ``|v|`` exactly."""
    from kvsnap.analysis.stats.catalogue import hist_index

    inner = kernel.hist_edges()[1:-1]
    assert np.all(np.diff(inner) > 0)
    rng = np.random.default_rng(7)
    near = inner.astype(np.float32)
    values = np.concatenate(
        [
            near,
            np.nextafter(near, np.float32(0)),
            np.nextafter(near, np.float32(np.inf)),
            (np.abs(rng.standard_normal(50_000)) * 10.0 ** rng.uniform(-10, 10, 50_000)).astype(np.float32),
            np.array([0.0, 1e-45, 1e-38, 1e-8, 9.99e-9, 1e8, 1e30, 3.4e38], np.float32),
        ]
    )
    rows = np.zeros((values.size, 8), np.float32)
    rows[:, 3] = values
    accumulator = HeadAccumulator(8, groups=frozenset({"norms"}))
    compiled_backend.add(accumulator, rows, np.arange(values.size))
    expected = np.bincount(hist_index(values.astype(np.float64)), minlength=accumulator.norm_hist.size)
    np.testing.assert_array_equal(accumulator.norm_hist, expected)


def test_position_bins_from_the_exponent_are_position_bins() -> None:
    """The kernel's norm-by-position bins (a position's float64 exponent) equal
    `catalogue.position_bins` (a logarithm) at every power of two and its neighbours, from 0 up
    to 2^60, and for negative positions."""
    from kvsnap.analysis.stats.catalogue import position_bins

    powers = np.array([1 << k for k in range(61)], dtype=np.int64)
    positions = np.unique(np.concatenate([powers - 1, powers, powers + 1, [0, -1, -5, 3, 1000]]))
    rows = np.ones((positions.size, 8), np.float32)
    compiled, reference = HeadAccumulator(8, groups=frozenset({"norms"})), HeadAccumulator(8)
    compiled_backend.add(compiled, rows, positions)
    expected = np.bincount(position_bins(positions[positions >= 0]), minlength=compiled.position_count.size)
    expected[0] += int(np.sum(positions < 0))  # negative positions count in bin 0, as before
    np.testing.assert_array_equal(compiled.position_count, expected)
    reference_backend.add(reference, rows, positions)
    np.testing.assert_array_equal(compiled.position_count, reference.position_count)


def test_zero_rows_and_constant_groups() -> None:
    """All-zero rows (norm 0, unit vector guarded) and constant groups (step 1) match too."""
    compiled, reference = HeadAccumulator(32), HeadAccumulator(32)
    rows = np.zeros((40, 32), np.float32)
    rows[5:] = 3.0
    compiled_backend.add(compiled, rows, np.arange(40))
    reference_backend.add(reference, rows, np.arange(40))
    got, expected = compiled.row(), reference.row()
    for name in ("norm_mean", "norm_min", "anisotropy"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-12, err_msg=name)
    for name in ("quant8_token_error", "quant2_channel_error"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, err_msg=name)


def test_statistics_stream_layer_by_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """stats_for_file yields a layer's table once the pass is past its last chunk, having made
    accumulators for that layer only; a series file (layers interleaved) gives the same rows."""
    import kvformat
    from kvsnap.analysis.engine import plan
    from kvsnap.analysis.engine import tables as stats
    from tests.conftest import write_series

    rng = np.random.default_rng(3)
    layers = [kvformat.Layer(*(rng.standard_normal((2, 30, 8), np.float32),) * 2) for _ in range(4)]
    kvformat.save(tmp_path / "layers.kv", layers, chunk_bytes=256)
    made = []

    class Counting(stats.HeadAccumulator):
        def __post_init__(self) -> None:
            made.append(self)
            super().__post_init__()

    monkeypatch.setattr(plan, "HeadAccumulator", Counting)
    tables = stats.stats_for_file(tmp_path / "layers.kv")
    first = next(tables)
    assert set(first["layer"].to_pylist()) == {0} and len(made) == 2 * 2  # 2 heads x K/V
    assert [t["layer"][0].as_py() for t in tables] == [1, 2, 3]
    write_series(tmp_path / "series.kv", chunk_bytes=64)
    streamed = [row for t in stats.stats_for_file(tmp_path / "series.kv") for row in t.to_pylist()]
    with kvformat.open(tmp_path / "series.kv") as snap:
        expected = {
            (layer, head, tensor): len(data.positions)
            for layer in (0, 1)
            for head in range(2)
            for tensor in ("k", "v")
            if (data := snap.head(layer, head)) is not None
        }
    assert {(r["layer"], r["head"], r["tensor"]): r["n_tokens"] for r in streamed} == expected
    assert len(streamed) == len(expected)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 128, 256])
def test_compiled_eigenvalues_match_lapack(n: int) -> None:
    """The compiled symmetric eigensolver (parallel over heads) against LAPACK: full rank with a
    wide spectrum, rank-deficient, zero; and at scales where the rotations' squares would
    overflow or underflow without the solver's own scaling."""
    from kvsnap.analysis.kernels.eigen import _eigenvalues, eigenvalues, eigenvalues_of

    rng = np.random.default_rng(n)
    for rows in (3 * n + 5, max(1, n // 3)):
        x = rng.standard_normal((rows, n)) * np.exp(rng.normal(0, 2, n))
        a = x.T @ x
        expected = np.linalg.eigvalsh(a)[::-1]
        for factor in (1.0, 1e-250, 1e250):
            tolerance = 1e-12 * expected[0] * factor
            np.testing.assert_allclose(eigenvalues(a * factor), expected * factor, rtol=0, atol=tolerance)
            out = np.empty(n)  # the compiled solver itself, not LAPACK's fallback
            assert _eigenvalues(a * factor, out, np.full((n, n), np.nan), np.full(n, np.nan))
            np.testing.assert_allclose(np.sort(out)[::-1], expected * factor, rtol=0, atol=tolerance)
    np.testing.assert_array_equal(eigenvalues(np.zeros((n, n))), np.zeros(n))
    # several matrices through one work space: each as if alone
    stack = np.stack([a, np.zeros((n, n)), a * 1e250, a[::-1, ::-1].copy()])
    alone = [eigenvalues(matrix) for matrix in stack]
    np.testing.assert_array_equal(eigenvalues_of(stack), np.stack(alone))


@pytest.mark.parametrize("seed", range(12))
def test_compiled_eigenvalues_with_zero_rows_among_the_others(seed: int) -> None:
    """Rows (and their columns) that are zero, or that become zero part-way through the reduction
    (a block-diagonal matrix), leave a reduction step without its update: the C reduction joins
    each step's update with the next step's product, so every order of a step with and without
    an update is checked against LAPACK, as are the sizes where the first or last step has none."""
    from kvsnap.analysis.kernels.eigen import eigenvalues, eigenvalues_of

    rng = np.random.default_rng(seed)
    stack = []
    for n in (2, 3, 4, 5, 9, 33, 64):
        x = rng.standard_normal((n + 3, n)) * np.exp(rng.normal(0, 1, n))
        a = x.T @ x
        zero = rng.random(n) < 0.3
        a[zero] = 0.0
        a[:, zero] = 0.0
        if seed % 3 == 0 and n > 4:  # two blocks: rows past the split reduce to zero early
            split = int(rng.integers(1, n - 1))
            a[:split, split:] = 0.0
            a[split:, :split] = 0.0
        expected = np.linalg.eigvalsh(a)[::-1]
        tolerance = 1e-12 * max(expected[0], 1.0)
        np.testing.assert_allclose(eigenvalues(a), expected, rtol=0, atol=tolerance)
        if n == 33:
            stack = [a, a[::-1, ::-1].copy(), np.eye(n), np.zeros((n, n)), a * 3.0]
    together = eigenvalues_of(np.stack(stack))
    np.testing.assert_array_equal(together, np.stack([eigenvalues(m) for m in stack]))


@pytest.mark.parametrize("seed", range(40))
def test_top_rows_are_the_largest_peaks_later_rows_first_among_ties(seed: int) -> None:
    """`kernel.top_rows` picks the rows the catalogue's (value, position) order ranks first,
    ties included (few distinct values), for fewer rows than k and for none."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 60))
    distinct = int(rng.integers(1, 6)) if seed % 2 else 1 << 20
    bits = rng.integers(0, distinct, n).astype(np.int32)
    expected = sorted(range(n), key=lambda i: (int(bits[i]), i), reverse=True)[:8]
    got = kernel.top_rows(bits, 8)
    assert sorted(got.tolist()) == sorted(expected)
