"""Captured K/V held to references outside kvsnap: the same GGUF weights, the same token
ids, in the checkpoint's channel order.

- A small numpy forward pass written here from the GGUF tensors alone (the ``gguf`` package's
  dequantization, transformers' row un-permutation, Hugging Face's half-split RoPE): SmolLM2's
  first two layers and Gemma-3's first layer. Always runs.
- Hugging Face transformers loading the GGUF itself (``tests/reference/transformers_kv.py``, in a
  Python of its own with torch: ``make reference``), every layer and head, post- and pre-RoPE K
  and V, for float16 and float32 conversions. Marked ``reference``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvsnap.analysis.stats.rope import Rope
from tests.conftest import PROSE
from tests.reference.runs import ReferenceRun

TOKENS = 96


def _capture(model_dir: Path, path: Path) -> list[int]:
    """Prefill ``TOKENS`` tokens of `PROSE` and snapshot the cache (kvsnap's capture path)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from kvsnap.capture.snapshot import snapshot_kv

    model, tokenizer = load(str(model_dir))
    tokens = list(tokenizer.encode(PROSE * 2))[:TOKENS]
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    snapshot_kv(cache, model, tokens=tokens).save(path)
    return tokens


def _relative(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


# -- an independent numpy forward pass ------------------------------------------------------------


class Gguf:
    """Tensors (float64, numpy shape) and key/values of a GGUF file, read with ``gguf``'s reader
    (through `open_gguf`, which parses a plain view of the same memory map)."""

    def __init__(self, path: Path) -> None:
        from kvsnap.capture.convert import open_gguf

        self.reader = open_gguf(path)
        self.tensors = {t.name: t for t in self.reader.tensors}

    def value(self, key: str) -> Any:
        return self.reader.fields[key].contents()

    def tensor(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return np.asarray(dequantize(t.data, t.tensor_type), np.float64).reshape(shape)

    def rows(self, name: str, indices: list[int]) -> np.ndarray:
        """Rows ``indices`` of a 2-D tensor (an embedding's tokens), dequantizing only those: a
        tensor's data holds one quantized row per row (262k x 640 for Gemma-3's embedding)."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        width = int(t.shape[0])
        return np.asarray(dequantize(t.data[indices], t.tensor_type), np.float64).reshape(len(indices), width)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' ``reverse_permute_weights``: llama.cpp's q/k rows in the checkpoint's order."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope_half(x: np.ndarray, base: float) -> np.ndarray:
    """Hugging Face's ``apply_rotary_pos_emb`` (``rotate_half``) on ``(heads, n, dim)``."""
    dim = x.shape[-1]
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.arange(x.shape[1])[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    rotated = np.concatenate([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + rotated * sin


def _heads(x: np.ndarray, heads: int) -> np.ndarray:
    return x.reshape(x.shape[0], heads, -1).transpose(1, 0, 2)


LLAMA_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


def llama_reference(
    gguf: Gguf, tokens: list[int], layers: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(K post-RoPE, K pre-RoPE, V) ``(kv_heads, n, head_dim)`` of the first ``layers`` layers."""
    heads, kv = gguf.value("llama.attention.head_count"), gguf.value("llama.attention.head_count_kv")
    eps, base = gguf.value("llama.attention.layer_norm_rms_epsilon"), gguf.value("llama.rope.freq_base")
    h = gguf.rows("token_embd.weight", tokens)
    n = len(tokens)
    out = []
    for layer in range(layers):
        w = {name: gguf.tensor(f"blk.{layer}.{name}.weight") for name in LLAMA_TENSORS}
        x = _rms(h, w["attn_norm"], eps)
        q = _heads(x @ _unpermute(w["attn_q"], heads).T, heads)
        pre = _heads(x @ _unpermute(w["attn_k"], kv).T, kv)
        v = _heads(x @ w["attn_v"].T, kv)
        k = _rope_half(pre, base)
        out.append((k, pre, v))
        q = _rope_half(q, base)
        group = heads // kv
        scores = q @ np.repeat(k, group, 0).transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attended = (weights @ np.repeat(v, group, 0)).transpose(1, 0, 2).reshape(n, -1)
        h = h + attended @ w["attn_output"].T
        x = _rms(h, w["ffn_norm"], eps)
        gate = x @ w["ffn_gate"].T
        h = h + ((gate / (1 + np.exp(-gate))) * (x @ w["ffn_up"].T)) @ w["ffn_down"].T
    return out


def gemma3_first_layer(gguf: Gguf, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(K post-RoPE, K pre-RoPE, V) of Gemma-3's layer 0 (a local layer: RoPE base 10000). The
    GGUF's norm weights already hold Gemma's ``1 + w``; the embedding scale is rounded to bfloat16
    as mlx-lm rounds it."""
    import ml_dtypes

    hidden = gguf.value("gemma3.embedding_length")
    kv = gguf.value("gemma3.attention.head_count_kv")
    eps = gguf.value("gemma3.attention.layer_norm_rms_epsilon")
    scale = float(np.float32(np.sqrt(hidden)).astype(ml_dtypes.bfloat16))
    h = gguf.rows("token_embd.weight", tokens) * scale
    x = _rms(h, gguf.tensor("blk.0.attn_norm.weight"), eps)
    pre = _rms(
        _heads(x @ gguf.tensor("blk.0.attn_k.weight").T, kv), gguf.tensor("blk.0.attn_k_norm.weight"), eps
    )
    v = _heads(x @ gguf.tensor("blk.0.attn_v.weight").T, kv)
    return _rope_half(pre, 10000.0), pre, v


def _stored(snap: kvformat.Snapshot, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    spec = snap.layers[layer]
    rope = Rope.from_metadata(snap.metadata, spec.attributes, spec.k_dim)
    ks, pres, vs = [], [], []
    for head in range(spec.num_heads):
        data = snap.head(layer, head)
        assert data is not None
        k = np.asarray(data.k, np.float32)
        ks.append(k)
        pres.append(rope.rotate(k, data.positions, inverse=True))
        vs.append(np.asarray(data.v, np.float32))
    return np.stack(ks), np.stack(pres), np.stack(vs)


def test_smollm2_keys_equal_a_numpy_forward_pass_in_checkpoint_order(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    from kvsnap.capture.fixtures import fetch_gguf

    path = tmp_path / "smollm2.kv"
    tokens = _capture(smollm2_dir, path)
    expected = llama_reference(Gguf(fetch_gguf("smollm2-135m")), tokens, layers=2)
    with kvformat.open(path) as snap:
        assert snap.metadata["rope"]["pairing"] == "half"
        for layer, reference in enumerate(expected):
            for name, got, want in zip(
                ("k", "pre_rope k", "v"), _stored(snap, layer), reference, strict=True
            ):
                for head in range(got.shape[0]):
                    error = _relative(got[head], want[head])
                    assert error <= 1e-2, (layer, head, name, error)  # float16 weights: ~1e-3
                    # and not in llama.cpp's order: the interleaved reading is far off
                    if name == "k":
                        swapped = np.concatenate([got[head][:, 0::2], got[head][:, 1::2]], -1)
                        assert _relative(swapped, want[head]) > 0.3


def test_gemma3_first_layer_equals_a_numpy_forward_pass(gemma3_dir: Path, tmp_path: Path) -> None:
    from kvsnap.capture.fixtures import fetch_gguf

    path = tmp_path / "gemma3.kv"
    tokens = _capture(gemma3_dir, path)
    reference = gemma3_first_layer(Gguf(fetch_gguf("gemma3-270m")), tokens)
    with kvformat.open(path) as snap:
        for name, got, want in zip(("k", "pre_rope k", "v"), _stored(snap, 0), reference, strict=True):
            assert _relative(got[0], want[0]) <= 1e-2, name


# -- Hugging Face transformers ----------------------------------------------------------------------


def _transformers(gguf: Path, tokens: list[int], tmp_path: Path) -> ReferenceRun:
    """The reference run started (it takes ~20 s; `_reference` waits for it)."""
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(tokens))
    return ReferenceRun("transformers_kv.py", gguf, [ids], tmp_path / "reference.npz")


def _reference(run: ReferenceRun) -> dict[str, np.ndarray]:
    """The arrays of a `_transformers` run, once it has finished."""
    with np.load(run.wait()) as arrays:
        return dict(arrays)


# Relative error per head and tensor, the targets; Gemma-3 in float16 drifts with depth
# (6e-4 at layer 0, ~0.1 at layer 17: float16 rounding in its residual stream), so its float16
# conversion is held to the target over its first 9 layers and the float32 one over all 18.
TARGETS = {
    ("smollm2-135m", "float16"): (1e-2, None),
    ("smollm2-135m", "float32"): (1e-5, None),
    ("gemma3-270m", "float16"): (1e-2, 9),
    ("gemma3-270m", "float32"): (1e-5, None),
}


@pytest.mark.reference
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_kv_equals_transformers_past_key_values(model: str, tmp_path: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    from kvsnap.capture.fixtures import fetch_gguf, fetch_model

    tokens = list(load_tokenizer(fetch_model(model, "float16")).encode(PROSE * 2))[:TOKENS]
    run = _transformers(fetch_gguf(model), tokens, tmp_path)  # runs while kvsnap captures
    captures = {}
    for dtype in ("float16", "float32"):
        path = tmp_path / f"{dtype}.kv"
        assert _capture(fetch_model(model, dtype), path) == tokens
        captures[dtype] = path
    reference = _reference(run)
    for dtype, path in captures.items():
        target, layers = TARGETS[(model, dtype)]
        worst = 0.0
        with kvformat.open(path) as snap:
            for layer in range(layers or snap.num_layers):
                stored = _stored(snap, layer)
                expected = (reference[f"k{layer}"], reference[f"pre{layer}"], reference[f"v{layer}"])
                for name, got, want in zip(("k", "pre_rope k", "v"), stored, expected, strict=True):
                    for head in range(got.shape[0]):
                        error = _relative(got[head], want[head])
                        worst = max(worst, error)
                        assert error <= target, (dtype, layer, head, name, error)
        print(f"{model} {dtype}: worst relative error {worst:.2e} (target {target:g})")
