"""Cross-head and cross-layer similarity (catalogue 9 and 10) against a float64 numpy reference,
including a sliding-window layer (partial overlap) and an absent layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvsnap.analysis.tools import similarity
from kvsnap.analysis.tools.similarity import head_similarity, similarity_for_file, similarity_rows


def reference(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    x, y = x.astype(np.float64), y.astype(np.float64)
    xc, yc = x - x.mean(0), y - y.mean(0)
    cka = np.linalg.norm(xc.T @ yc) ** 2 / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc))
    cos = np.mean(np.sum(x * y, 1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)))
    return float(cka), float(cos)


def make_file(path: Path, dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    base = rng.standard_normal((1, 50, 8))
    k0 = (base + 0.3 * rng.standard_normal((3, 50, 8))).astype(dtype)  # related heads
    k1 = (k0[:, 20:] @ rng.standard_normal((8, 8)) + 0.1 * rng.standard_normal((3, 30, 8))).astype(dtype)
    kvformat.save(
        path,
        [
            kvformat.Layer(k0, k0[:, :, :4].copy()),
            None,  # absent: layer 0 pairs with layer 2
            kvformat.Layer(k1, k1[:, :, :4].copy(), positions=np.arange(20, 50)),  # window of 30
        ],
        chunk_bytes=7 * 8 * np.dtype(dtype).itemsize,  # odd chunks: 7 tokens
    )
    return k0, k1, np.arange(20, 50)


@pytest.mark.parametrize("window_bytes", [1 << 20, 8 * 8 * 3 * 5])  # one window, or 5-token windows
def test_similarity_equals_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window_bytes: int
) -> None:
    monkeypatch.setattr(similarity, "WINDOW_BYTES", window_bytes)
    k0, k1, _ = make_file(tmp_path / "s.kv")
    rows = list(similarity_rows(tmp_path / "s.kv"))
    heads = [r for r in rows if r["kind"] == "head" and r["tensor"] == "k"]
    assert {(r["layer"], r["head"], r["other_head"]) for r in heads} == {
        (layer, i, j) for layer in (0, 2) for i, j in ((0, 1), (0, 2), (1, 2))
    }
    for r in heads:
        data = k0 if r["layer"] == 0 else k1
        cka, cos = reference(data[r["head"]], data[r["other_head"]])
        assert r["cka"] == pytest.approx(cka, rel=1e-9)
        assert r["cosine_mean"] == pytest.approx(cos, rel=1e-9)
        assert r["n_tokens"] == data.shape[1]
    layers = [r for r in rows if r["kind"] == "layer" and r["tensor"] == "k"]
    assert [(r["layer"], r["other_layer"], r["head"]) for r in layers] == [(0, 2, h) for h in range(3)]
    for r in layers:
        cka, cos = reference(k0[r["head"], 20:], k1[r["head"]])  # only the shared positions
        assert r["n_tokens"] == 30
        assert r["cka"] == pytest.approx(cka, rel=1e-9)
        assert r["cosine_mean"] == pytest.approx(cos, rel=1e-9)
    v = next(r for r in rows if r["kind"] == "head" and r["tensor"] == "v" and r["layer"] == 0)
    assert v["cka"] == pytest.approx(reference(k0[0, :, :4], k0[1, :, :4])[0], rel=1e-9)


def test_similarity_of_bfloat16_and_related_heads(tmp_path: Path) -> None:
    import ml_dtypes

    k0, _, _ = make_file(tmp_path / "b.kv", dtype=ml_dtypes.bfloat16)
    table = head_similarity(tmp_path / "b.kv")
    row = table.filter((table["kind"] == "head") & (table["tensor"] == "k") & (table["layer"] == 0)).row(
        0, named=True
    )
    cka, cos = reference(k0[0], k0[1])
    assert row["cka"] == pytest.approx(cka, rel=1e-6)
    assert row["cosine_mean"] == pytest.approx(cos, rel=1e-6)
    assert row["cka"] > 0.5  # heads built from a shared signal are similar
    tables = list(similarity_for_file(tmp_path / "b.kv"))
    assert sum(t.num_rows for t in tables) == table.height


def test_similarity_identical_and_rotated_heads_have_cka_one(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6))
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    k = np.stack([x, x @ q * 3.0]).astype(np.float32)
    kvformat.save(tmp_path / "r.kv", [kvformat.Layer(k, k)])
    row = next(r for r in similarity_rows(tmp_path / "r.kv") if r["kind"] == "head")
    assert row["cka"] == pytest.approx(1.0, rel=1e-6)  # CKA ignores rotation and scale
    assert row["cosine_mean"] < 0.99  # the token-wise cosine does not
