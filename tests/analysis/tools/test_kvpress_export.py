"""``kvsnap export --duo-attention`` and ``--expected-attention-stats`` on synthetic captures: the
head pattern from the attention statistics' own rows, the query statistics against numpy over
queries whose RoPE this test applies itself (half pairing, as transformers' ``rotate_half``),
pooled over files; the command's refusals. kvpress loading them is held in
``test_kvpress.py`` (reference)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvformat import QuerySpec
from kvsnap.analysis.attention.head_importance import attention_rows
from kvsnap.analysis.tools.kvpress_export import duo_attention_pattern, expected_attention_stats
from kvsnap.cli import main

LAYERS, KV_HEADS, HEADS, DIM, TOKENS, BASE = 3, 2, 4, 16, 80, 10000.0


def _rotated(q: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """RoPE as transformers applies it: ``q cos + rotate_half(q) sin``."""
    half = DIM // 2
    theta = positions[:, None] * BASE ** (-np.arange(0, DIM, 2) / DIM)[None, :]
    cos, sin = np.cos(theta), np.sin(theta)
    first, second = q[..., :half], q[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def _capture(path: Path, seed: int) -> np.ndarray:
    """A capture whose post-RoPE queries come from pre-RoPE ``(layers, heads, tokens, dim)``,
    returned."""
    rng = np.random.default_rng(seed)
    spec = kvformat.LayerSpec(
        KV_HEADS, DIM, DIM, kvformat.FLOAT32,
        queries=QuerySpec(num_heads=HEADS, dim=DIM, dtype=kvformat.FLOAT32, scale=DIM**-0.5,
                          kv_heads=(0, 0, 1, 1)),
    )  # fmt: skip
    pre = rng.standard_normal((LAYERS, HEADS, TOKENS, DIM)) + rng.standard_normal((LAYERS, HEADS, 1, DIM))
    positions = np.arange(TOKENS)
    rope = {"base": BASE, "dims": DIM, "pairing": "half", "traditional": False, "scaling": None}
    metadata = {"prompt_tokens": TOKENS - 8, "rope": rope, "model": {"name": "tiny"}}
    with kvformat.Writer(path, [spec] * LAYERS, metadata=metadata) as writer:
        for layer in range(LAYERS):
            k = rng.standard_normal((KV_HEADS, TOKENS, DIM)).astype(np.float32)
            k[:, 0] *= 5
            writer.append(layer, k, rng.standard_normal((KV_HEADS, TOKENS, DIM)).astype(np.float32))
            writer.append_queries(layer, _rotated(pre[layer], positions).astype(np.float32), positions)
        writer.snapshot({"tokens": [rng.integers(0, 5, TOKENS).tolist()]})
    return pre


def test_the_duo_attention_pattern_is_each_kv_heads_largest_need(tmp_path: Path) -> None:
    path = tmp_path / "a.kv"
    _capture(path, 0)
    pattern = duo_attention_pattern(path, window=16)
    rows = list(attention_rows(path, window=16))
    largest = max(r["streaming_error"] for r in rows)
    expected = np.zeros((LAYERS, KV_HEADS))
    for row in rows:
        retrieval = 0.0 if math.isnan(row["retrieval_score"]) else row["retrieval_score"]
        need = max(row["streaming_error"] / largest, retrieval)
        expected[row["layer"], row["kv_head"]] = max(expected[row["layer"], row["kv_head"]], min(need, 1.0))
    np.testing.assert_allclose(pattern, expected)
    assert pattern.max() == 1.0 and (pattern > 0).all()
    out = tmp_path / "duo"
    assert main(["export", str(path), "--duo-attention", str(out), "--window", "16"]) == 0
    np.testing.assert_allclose(
        np.loadtxt(out / "full_attention_heads.tsv", delimiter="\t"), pattern, atol=1e-6
    )
    config = json.loads((out / "config.json").read_text())
    assert config["sink_size"] == 4 and config["recent_size"] == 16
    assert main(["export", str(path), "--duo-attention", str(out)]) == 2  # exists: --force replaces it
    assert main(["export", str(path), "--duo-attention", str(out), "--force"]) == 0


def test_the_query_statistics_are_the_pre_rope_queries_mean_and_covariance(tmp_path: Path) -> None:
    pre = [_capture(tmp_path / f"{i}.kv", i) for i in range(2)]
    mean, cov, config = expected_attention_stats([tmp_path / "0.kv", tmp_path / "1.kv"])
    pooled = np.concatenate([p[:, :, 4:] for p in pre], axis=2)  # past the 4 sinks, both files
    expected_mean = pooled.mean(axis=2)
    centred = pooled - expected_mean[:, :, None]
    expected_cov = np.einsum("lhni,lhnj->lhij", centred, centred) / (pooled.shape[2] - 1)
    np.testing.assert_allclose(mean, expected_mean, atol=1e-5)
    np.testing.assert_allclose(cov, expected_cov, atol=1e-4)
    assert mean.dtype == cov.dtype == np.float32 and cov.shape == (LAYERS, HEADS, DIM, DIM)
    assert config == {
        "num_layers": LAYERS,
        "num_heads": HEADS,
        "head_dim": DIM,
        "dataset_name": "kvsnap:0.kv,1.kv",
        "model_name": "tiny",
        "num_samples": 2,
        "sample_seq_len": TOKENS,
        "n_sink": 4,
    }
    from safetensors.numpy import load_file

    out = tmp_path / "stats"
    assert main(["export", str(tmp_path / "*.kv"), "--expected-attention-stats", str(out)]) == 0
    written = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(written["query_mean"], mean)
    assert json.loads((out / "config.json").read_text())["num_samples"] == 2


def test_exports_refuse_what_they_cannot_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "a.kv"
    _capture(path, 0)
    assert main(["export", str(path)]) == 2
    assert "-o DIR" in capsys.readouterr().err
    assert main(["export", str(path), str(path), "--duo-attention", str(tmp_path / "d")]) == 2
    assert "takes one capture" in capsys.readouterr().err
    plain = tmp_path / "plain.kv"
    kvformat.save(plain, [kvformat.Layer(np.ones((1, 4, 8), np.float32), np.ones((1, 4, 8), np.float32))])
    assert main(["export", str(plain), "--expected-attention-stats", str(tmp_path / "s")]) == 2
    assert "no queries" in capsys.readouterr().err
    assert not (tmp_path / "s").exists() and not (tmp_path / "d").exists()
