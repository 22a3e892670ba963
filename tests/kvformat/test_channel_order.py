"""Channel order of K: files in llama.cpp's GGUF order (RoPE pairs ``(2i, 2i+1)``) and in the
checkpoint's (``(i, i + dims/2)``) are told apart and reordered on request (`diff` comparing them
in one order: `tests/analysis/tools/test_diff.py`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvsnap.analysis import checkpoint_keys
from kvsnap.analysis.stats.rope import Rope, interleaved_to_half
from kvsnap.cli import main

DIM, TOKENS, HEADS = 16, 24, 2


def _metadata(pairing: str) -> dict[str, object]:
    return {
        "model": {"name": "m", "architecture": "llama", "gguf": {"file": "m.gguf", "sha256": "0" * 64}},
        "rope": {
            "base": 10000.0,
            "scaling": None,
            "dims": DIM,
            "traditional": pairing == "interleaved",
            "pairing": pairing,
        },
    }


def _pair(tmp_path: Path) -> tuple[Path, Path, np.ndarray]:
    """The same post-RoPE keys stored in the checkpoint's order (B) and in llama.cpp's (A)."""
    rng = np.random.default_rng(0)
    pre = rng.standard_normal((HEADS, TOKENS, DIM)).astype(np.float32)
    half = Rope(10000.0, DIM, "half")
    k = np.stack([half.rotate(pre[h], np.arange(TOKENS)) for h in range(HEADS)])
    v = rng.standard_normal((HEADS, TOKENS, DIM)).astype(np.float32)
    # llama.cpp's order: checkpoint channel i -> 2i, i + dims/2 -> 2i + 1
    to_gguf = np.empty(DIM, np.int64)
    to_gguf[0::2], to_gguf[1::2] = np.arange(DIM // 2), np.arange(DIM // 2, DIM)
    a, b = tmp_path / "gguf-order.kv", tmp_path / "checkpoint-order.kv"
    kvformat.save(
        a, [kvformat.Layer(np.ascontiguousarray(k[..., to_gguf]), v)], metadata=_metadata("interleaved")
    )
    kvformat.save(b, [kvformat.Layer(k, v)], metadata=_metadata("half"))
    return a, b, k


def test_the_interleaved_file_is_the_same_rotation_in_another_order(tmp_path: Path) -> None:
    a, _, k = _pair(tmp_path)
    with kvformat.open(a) as snap:
        stored = snap.head(0, 1)
        assert stored is not None
        interleaved = Rope(10000.0, DIM, "interleaved")
        pre = interleaved.rotate(stored.k, stored.positions, inverse=True)
        np.testing.assert_allclose(interleaved_to_half(pre, DIM), Rope(10000.0, DIM, "half").rotate(
            k[1], np.arange(TOKENS), inverse=True), atol=1e-5)  # fmt: skip


def test_checkpoint_keys_reorders_only_gguf_order_files(tmp_path: Path) -> None:
    a, b, k = _pair(tmp_path)
    with kvformat.open(a) as snap:
        for head in range(HEADS):
            np.testing.assert_array_equal(checkpoint_keys(snap, 0, head), k[head])
    with kvformat.open(b) as snap:
        np.testing.assert_array_equal(checkpoint_keys(snap, 0, 0), k[0])


def test_info_names_the_channel_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, _ = _pair(tmp_path)
    assert main(["info", str(a)]) == 0
    assert "K channel order: llama.cpp's GGUF order" in capsys.readouterr().out
    assert main(["info", str(b)]) == 0
    assert "K channel order: RoPE pairs (i, i + dims/2), the checkpoint's order" in capsys.readouterr().out
