"""Property test: every per-head statistic equals a float64 numpy reference computed on the fully
loaded arrays, over random snapshots (float32/float16/bfloat16, odd chunk sizes, absent layers,
non-contiguous sliding-window positions)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvformat
from kvsnap.analysis.engine.tables import stats_rows
from kvsnap.analysis.stats import QUANT_BITS, QUANT_GROUP, RANKS

ROPE = {"rope": {"base": 10000.0, "dims": 8, "pairing": "interleaved", "scaling": None}}
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def token_quant_error(x: np.ndarray, bits: int) -> float:
    """Reference: min-max groups of QUANT_GROUP channels per token (the last group partial)."""
    levels, total = (1 << bits) - 1, 0.0
    for start in range(0, x.shape[1], QUANT_GROUP):
        g = x[:, start : start + QUANT_GROUP].astype(np.float32)
        low, high = g.min(1, keepdims=True), g.max(1, keepdims=True)
        step = np.where(high > low, (high - low) / levels, np.float32(1.0))
        level = np.round((g - low) * (np.float32(1.0) / step))  # the step's reciprocal, as defined
        total += float((((level * step + low) - g).astype(np.float64) ** 2).sum())
    return total


def reference(x: np.ndarray, positions: np.ndarray) -> dict[str, object]:
    x = x.astype(np.float64)
    norms = np.linalg.norm(x, axis=1)
    eig = np.clip(np.sort(np.linalg.eigvalsh(np.cov(x.T, bias=True)))[::-1], 0, None)
    bins = np.where(positions > 0, np.floor(np.log2(np.maximum(positions, 1))).astype(int) + 1, 0)
    by_position = [norms[bins == b].mean() if (bins == b).any() else np.nan for b in range(bins.max() + 1)]
    pairs = x[:, 0:8:2] ** 2 + x[:, 1:8:2] ** 2
    return {
        "norm_mean": norms.mean(),
        "norm_std": norms.std(),
        "norm_min": norms.min(),
        "norm_max": norms.max(),
        "norm_sq_mean": (norms**2).mean(),
        "channel_mean": x.mean(0),
        "channel_var": x.var(0),
        "channel_absmax": np.abs(x).max(0),
        "eigenvalues": eig,
        "anisotropy": np.linalg.norm((x / np.maximum(norms, 1e-30)[:, None]).mean(0)),
        "sink_ratio": norms[0] / norms.mean() if positions[0] == 0 else np.nan,
        "norm_by_position": by_position,
        "rope_band_energy": pairs.sum(0) / pairs.sum(),
        **{f"rank{r}_error": 1 - eig[:r].sum() / eig.sum() for r in RANKS},
    }


@st.composite
def snapshots(draw: st.DrawFn) -> tuple[np.dtype, list[np.ndarray | None], list[np.ndarray], int]:
    dtype = draw(st.sampled_from(DTYPES))
    dim = draw(st.sampled_from([8, 12, 40]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    layers: list[np.ndarray | None] = []
    positions: list[np.ndarray] = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()) and layers:
            layers.append(None)  # absent layer
            positions.append(np.empty(0, np.int64))
            continue
        n = draw(st.integers(2, 70))
        scale = np.exp(rng.normal(0, 1, dim))
        layers.append((rng.standard_normal((2, n, dim)) * scale).astype(dtype))
        if draw(st.booleans()):  # sliding window: keep 1 + the last n-1 of a longer run
            start = draw(st.integers(2, 500))
            positions.append(np.concatenate([[0], np.arange(start, start + n - 1)]))
        else:
            positions.append(np.arange(n))
    chunk_tokens = draw(st.integers(1, 40))
    return np.dtype(dtype), layers, positions, chunk_tokens * dim * np.dtype(dtype).itemsize


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=snapshots())
def test_every_statistic_equals_the_float64_reference(tmp_path: Path, case: tuple) -> None:
    _dtype, layers, positions, chunk_bytes = case
    path = tmp_path / "p.kv"
    path.unlink(missing_ok=True)
    kvformat.save(
        path,
        [
            None if k is None else kvformat.Layer(k, k[:, :, ::-1].copy(), pos)
            for k, pos in zip(layers, positions, strict=True)
        ],
        metadata=ROPE,
        chunk_bytes=chunk_bytes,
    )
    rows = stats_rows(path)
    present = [i for i, k in enumerate(layers) if k is not None]
    assert {r["layer"] for r in rows} == set(present)
    for row in rows:
        k = layers[row["layer"]]
        assert k is not None
        data = k[row["head"]] if row["tensor"] == "k" else k[row["head"], :, ::-1]
        expected = reference(data, positions[row["layer"]])
        assert row["n_tokens"] == data.shape[0]
        for name, value in expected.items():
            if name == "rope_band_energy" and row["tensor"] == "v":
                continue
            np.testing.assert_allclose(row[name], value, rtol=1e-6, atol=1e-9, err_msg=name)
        for bits in QUANT_BITS:
            x = data.astype(np.float64)
            expected_error = token_quant_error(data, bits) / float((x * x).sum())
            assert row[f"quant{bits}_token_error"] == pytest.approx(expected_error, rel=1e-5), bits
