"""An independent writer of go-mlx's MLXKV001 layout (../shared/formats/mlxkv001.md), and the
golden and hostile files built with it.

    python tests/mlxkv/generate.py      # rewrites tests/mlxkv/*.mlxkv and expected.json

`kvformat.importers.mlxkv` must import every golden file to exactly the arrays this writer was given (q8:
the values ``int8 * scale`` go-mlx decodes to) and refuse every hostile one with the error named
in ``expected.json``. The files are deterministic (fixed seeds), so a test holds them equal to a
fresh run.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
NATIVE = {"float32": np.float32, "F32": np.float32, "float16": np.float16, "F16": np.float16}
NATIVE |= {"bfloat16": ml_dtypes.bfloat16, "BF16": ml_dtypes.bfloat16}


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def i32(value: int) -> bytes:
    return struct.pack("<i", value)


def text(value: str) -> bytes:
    raw = value.encode()
    return u32(len(raw)) + raw


def i32s(values: list[int]) -> bytes:
    return u32(len(values)) + np.asarray(values, "<i4").tobytes()


def q8(x: np.ndarray) -> tuple[float, np.ndarray]:
    """go-mlx's q8: one scale per tensor, max|x| / 127 (1 when all zero), round half away from
    zero, clamp to +-127."""
    peak = float(np.abs(x).max()) if x.size else 0.0
    scale = np.float32(peak / 127 if peak else 1.0)
    scaled = x.astype(np.float32) / scale
    q = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), -127, 127).astype(np.int8)
    return float(scale), q


def tensor(x: np.ndarray, encoding: str) -> bytes:
    """One TENSOR: ``float32`` (tag 0), ``q8`` (tag 1) or ``native:NAME`` (tag 2)."""
    flat = np.asarray(x).reshape(-1)
    if encoding == "q8" and np.isfinite(flat.astype(np.float32)).all():
        scale, q = q8(flat)
        return u32(1) + u32(flat.size) + struct.pack("<f", scale) + q.tobytes()
    if encoding.startswith("native:"):
        name = encoding.split(":", 1)[1]
        data = flat.astype(NATIVE[name]).tobytes()
        return u32(2) + u32(flat.size) + text(name) + u32(len(data)) + data
    return u32(0) + u32(flat.size) + flat.astype("<f4").tobytes()


def decoded(x: np.ndarray, encoding: str) -> np.ndarray:
    """What a reader gets back for ``x`` written with ``encoding``."""
    flat = np.asarray(x)
    if encoding == "q8" and np.isfinite(flat.astype(np.float32)).all():
        scale, q = q8(flat.reshape(-1))
        return (q.astype(np.float32) * np.float32(scale)).reshape(flat.shape)
    if encoding.startswith("native:"):
        return flat.astype(NATIVE[encoding.split(":", 1)[1]])
    return flat.astype(np.float32)


def f32s(x: np.ndarray) -> bytes:
    flat = np.asarray(x, "<f4").reshape(-1)
    return u32(flat.size) + flat.tobytes()


@dataclass
class Layer:
    """A layer record: ``heads`` of (K, V) ``(T, D)`` each, or a slab (``slab_k``/``slab_v`` in
    ``[B, H, L, D]`` or ``[L, H, D]``), each tensor written with ``encodings[i % len]``."""

    index: int
    heads: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    encodings: tuple[str, ...] = ("float32",)
    slab_k: np.ndarray | None = None
    slab_v: np.ndarray | None = None
    cache_index: int | None = None
    cache_mode: str = ""
    payloads: tuple[bytes, ...] = ()
    max_size: int = 0


@dataclass
class Snapshot:
    version: int
    architecture: str
    num_layers: int
    num_kv_heads: int
    seq_len: int
    head_dim: int
    num_query_heads: int
    tokens: list[int]
    layers: list[Layer]
    token_offset: int = 0
    generated: list[int] = field(default_factory=list)
    logit_shape: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None

    def to_bytes(self) -> bytes:
        v = self.version
        out = [b"MLXKV001", u32(v), text(self.architecture)]
        out += [u32(x) for x in (self.num_layers, self.num_kv_heads, self.seq_len, self.head_dim)]
        out.append(u32(self.num_query_heads))
        if v >= 2:
            out.append(u32(self.token_offset))
        out.append(i32s(self.tokens))
        if v >= 2:
            out.append(i32s(self.generated))
        out.append(u32(len(self.layers)))
        for layer in self.layers:
            out += [i32(layer.index), i32(layer.index if layer.cache_index is None else layer.cache_index)]
            out.append(u32(len(layer.heads)))
            if v >= 5:
                out.append(text(layer.cache_mode))
                out.append(u32(len(layer.payloads)) + b"".join(u32(len(p)) + p for p in layer.payloads))
            if v >= 6:
                out.append(u32(layer.max_size))
            if v >= 4:
                for slab in (layer.slab_k, layer.slab_v):
                    shape = [] if slab is None else list(slab.shape)
                    out.append(i32s(shape))
                    out.append(tensor(np.zeros(0) if slab is None else slab, layer.encodings[0]))
            for h, (k, val) in enumerate(layer.heads):
                if v >= 3:
                    enc = layer.encodings
                    out += [tensor(k, enc[(2 * h) % len(enc)]), tensor(val, enc[(2 * h + 1) % len(enc)])]
                else:
                    out += [f32s(k), f32s(val)]
        if v >= 2:
            out.append(i32s(self.logit_shape))
            out.append(f32s(np.zeros(0) if self.logits is None else self.logits))
        return b"".join(out)


def _kv(rng: np.random.Generator, tokens: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    return (
        rng.standard_normal((tokens, dim)).astype(np.float32),
        rng.standard_normal((tokens, dim)).astype(np.float32),
    )


def golden() -> dict[str, Snapshot]:
    """One file per layout version, plus every tag and dtype, slabs and sliding windows."""
    files: dict[str, Snapshot] = {}
    for version in range(1, 7):
        rng = np.random.default_rng(version)
        seq_len, dim = 12, 8
        layers = [
            Layer(0, [_kv(rng, seq_len, dim) for _ in range(2)]),
            Layer(2, [_kv(rng, 5, dim), _kv(rng, 5, dim)], max_size=5 if version >= 6 else 0),  # window
        ]
        if version >= 3:
            layers[0].encodings = ("q8", "float32")
            layers[1].encodings = ("native:float16",)
        files[f"v{version}.mlxkv"] = Snapshot(
            version, "llama", 3, 2, seq_len, dim, 4, list(range(100, 100 + seq_len)), layers,
            token_offset=seq_len if version >= 2 else 0,
            generated=[105, 106, 107] if version >= 2 else [],
            logit_shape=[1, 6] if version >= 2 else [],
            logits=rng.standard_normal(6).astype(np.float32) if version >= 2 else None,
        )  # fmt: skip
    rng = np.random.default_rng(7)
    # Every native dtype name (and alias) of tag 2, in a version-3 file (tag 2 without a bump).
    names = ["float32", "F32", "float16", "F16", "bfloat16", "BF16"]
    files["native-dtypes.mlxkv"] = Snapshot(
        3, "gemma3", len(names), 1, 6, 4, 2, list(range(6)),
        [Layer(i, [_kv(rng, 6, 4)], (f"native:{n}",)) for i, n in enumerate(names)],
    )  # fmt: skip
    # Slabs: [B, H, L, D] with a batch of 2 (one layer a window of 4), and [L, H, D].
    bhld = rng.standard_normal((2, 3, 7, 4)).astype(np.float32)
    window = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    lhd = rng.standard_normal((4, 3, 4)).astype(np.float32)
    files["slabs.mlxkv"] = Snapshot(
        6, "qwen3", 2, 3, 7, 4, 6, list(range(7)),
        [
            Layer(0, slab_k=bhld, slab_v=bhld * 2, encodings=("native:bfloat16",)),
            Layer(1, slab_k=window, slab_v=window - 1, max_size=4, cache_mode="rotating"),
        ],
        generated=[6], logit_shape=[2, 1, 5], logits=rng.standard_normal(10).astype(np.float32),
    )  # fmt: skip
    files["slab-lhd.mlxkv"] = Snapshot(
        4, "qwen3", 1, 3, 4, 4, 6, list(range(4)), [Layer(0, slab_k=lhd, slab_v=lhd - 1)],
        logit_shape=[5], logits=rng.standard_normal(5).astype(np.float32),
    )  # fmt: skip
    # A layer mixing tags (q8, a NaN that falls back to float32, native float16): stored as float32.
    k, v = _kv(rng, 6, 4)
    k[2, 1] = np.nan
    files["mixed-tags.mlxkv"] = Snapshot(
        5, "llama", 1, 2, 6, 4, 2, list(range(6)),
        [Layer(0, [(k, v), _kv(rng, 6, 4)], ("q8", "q8", "native:float16", "float32"), payloads=(b"x",))],
    )  # fmt: skip
    return files


def _base() -> Snapshot:
    return golden()["v6.mlxkv"]


def _edit(offset: int, value: bytes) -> Any:
    def apply(data: bytes) -> bytes:
        at = offset if offset >= 0 else len(data) + offset
        return data[:at] + value + data[at + len(value) :]

    return apply


def hostile() -> dict[str, tuple[str, bytes]]:
    """name -> (expected error class, bytes)."""
    base = _base().to_bytes()
    arch = len(b"llama")
    after_arch = 8 + 4 + 4 + arch  # magic, version, architecture
    first_layer = after_arch + 5 * 4 + 4 + (4 + 4 * 12) + (4 + 4 * 3) + 4  # ... tokens, generated, count
    huge = bytearray(base)
    # The first tensor of the first layer (its key slab, empty) claims 2^31 float32 elements.
    slab_tensor = (
        first_layer + 4 + 4 + 4 + (4 + 0) + 4 + 4 + 4
    )  # index, cache, heads, mode, payloads, max, shape
    struct.pack_into("<I", huge, slab_tensor + 4, 2**31)
    bad_tag = bytearray(base)
    struct.pack_into("<I", bad_tag, slab_tensor, 3)
    wrong_layer = bytearray(base)
    struct.pack_into("<i", wrong_layer, first_layer, 9)
    twice = _base()
    twice.layers[1].index = 0
    mismatch = _base()
    mismatch.layers[0].heads[0] = (mismatch.layers[0].heads[0][0], mismatch.layers[0].heads[0][1][:5])
    ragged = _base()
    ragged.layers[0].heads[0] = (ragged.layers[0].heads[0][0][:, :5], ragged.layers[0].heads[0][1][:, :5])
    too_long = _base()
    too_long.seq_len = 4
    turbo = _base()
    turbo.layers[0].cache_mode = "turboquant"
    int4 = _base()
    int4.layers[1].encodings = ("native:int4",)
    NATIVE["int4"] = np.float16  # written as float16 bytes under an unknown name
    files = {
        "bad-magic.mlxkv": ("CorruptFileError", b"MLXKV002" + base[8:]),
        "version-7.mlxkv": ("UnsupportedVersionError", _edit(8, u32(7))(base)),
        "version-0.mlxkv": ("UnsupportedVersionError", _edit(8, u32(0))(base)),
        "huge-count.mlxkv": ("TruncatedFileError", bytes(huge)),
        "unknown-tag.mlxkv": ("UnsupportedFeatureError", bytes(bad_tag)),
        "layer-out-of-range.mlxkv": ("CorruptFileError", bytes(wrong_layer)),
        "layer-twice.mlxkv": ("CorruptFileError", twice.to_bytes()),
        "kv-token-mismatch.mlxkv": ("CorruptFileError", mismatch.to_bytes()),
        "not-head-dim-rows.mlxkv": ("CorruptFileError", ragged.to_bytes()),
        "more-tokens-than-seq-len.mlxkv": ("CorruptFileError", too_long.to_bytes()),
        "turboquant.mlxkv": ("UnsupportedFeatureError", turbo.to_bytes()),
        "unknown-native-dtype.mlxkv": ("UnsupportedFeatureError", int4.to_bytes()),
        "trailing-bytes.mlxkv": ("CorruptFileError", base + b"\0"),
        "truncated.mlxkv": ("TruncatedFileError", base[: len(base) // 2]),
    }
    del NATIVE["int4"]
    return files


def generate(directory: Path = HERE) -> dict[str, Any]:
    expected: dict[str, Any] = {"golden": {}, "hostile": {}}
    for name, snapshot in golden().items():
        (directory / name).write_bytes(snapshot.to_bytes())
        expected["golden"][name] = {"version": snapshot.version, "layers": [l.index for l in snapshot.layers]}
    (directory / "bad").mkdir(exist_ok=True)
    for name, (error, data) in hostile().items():
        (directory / "bad" / name).write_bytes(data)
        expected["hostile"][name] = error
    (directory / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    return expected


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
