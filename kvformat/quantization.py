"""Affine-quantized K/V rows, stored natively (as mlx-lm's QuantizedKVCache holds them).

A quantized row of ``dim`` elements with ``bits`` per element and groups of ``group_size`` is
``dim * bits / 32`` little-endian uint32 words (element ``j`` of a word in bits
``[j*bits, (j+1)*bits)``, least significant first), then ``dim / group_size`` scales, then as many
biases, both in the layer's float dtype. Element ``i`` dequantizes to
``scale[i // group_size] * q_i + bias[i // group_size]``, computed in the layer's dtype (``q_i``
converted to it, the product rounded, then the sum rounded: what mlx's ``dequantize`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat.errors import InvalidLayoutError

BITS = (2, 4, 8)
GROUP_SIZES = (32, 64, 128)

Parts = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Quantization:
    """Affine quantization of a layer: ``bits`` per element, ``group_size`` elements per scale."""

    bits: int
    group_size: int

    def to_json(self) -> dict[str, Any]:
        return {"mode": "affine", "bits": self.bits, "group_size": self.group_size}

    def check_dim(self, dim: int) -> None:
        if dim % self.group_size or (dim * self.bits) % 32:
            raise InvalidLayoutError(f"head dim {dim} is not a multiple of group size {self.group_size}")

    def widths(self, dim: int) -> tuple[int, int]:
        """(uint32 words, scales) per row of ``dim`` elements."""
        return dim * self.bits // 32, dim // self.group_size

    def row_bytes(self, dim: int, itemsize: int) -> int:
        words, groups = self.widths(dim)
        return 4 * words + 2 * groups * itemsize

    def join(self, parts: Parts) -> np.ndarray:
        """``(packed (n, W) uint32, scales (n, G), biases (n, G))`` -> rows ``(n, row_bytes)`` uint8."""
        packed, scales, biases = (np.ascontiguousarray(p) for p in parts)
        n = packed.shape[0]
        return np.concatenate(
            [
                packed.astype("<u4", copy=False).view(np.uint8).reshape(n, -1),
                scales.view(np.uint8).reshape(n, -1),
                biases.view(np.uint8).reshape(n, -1),
            ],
            axis=1,
        )

    def split(self, rows: np.ndarray, dim: int, dtype: np.dtype) -> Parts:
        """Rows ``(n, row_bytes)`` uint8 -> (packed, scales, biases) views."""
        words, groups = self.widths(dim)
        n = rows.shape[0]
        scale_bytes = groups * dtype.itemsize
        packed = np.ascontiguousarray(rows[:, : 4 * words]).view("<u4").reshape(n, words)
        scales = (
            np.ascontiguousarray(rows[:, 4 * words : 4 * words + scale_bytes]).view(dtype).reshape(n, groups)
        )
        biases = np.ascontiguousarray(rows[:, 4 * words + scale_bytes :]).view(dtype).reshape(n, groups)
        return packed, scales, biases

    def dequantize(self, parts: Parts, dtype: np.dtype) -> np.ndarray:
        """(packed, scales, biases) -> ``(n, dim)`` values in ``dtype``."""
        packed, scales, biases = parts
        per_word = 32 // self.bits
        shifts = (np.arange(per_word, dtype=np.uint32) * self.bits)[None, None, :]
        q = (packed[:, :, None] >> shifts) & np.uint32((1 << self.bits) - 1)
        q = q.reshape(packed.shape[0], -1).astype(dtype)
        scale = np.repeat(scales.astype(dtype, copy=False), self.group_size, axis=1)
        bias = np.repeat(biases.astype(dtype, copy=False), self.group_size, axis=1)
        # An overflowed scale (inf) gives inf, or NaN for inf * 0: data, not a warning to print.
        with np.errstate(invalid="ignore", over="ignore"):
            return np.asarray(scale * q + bias, dtype=dtype)


def parse(obj: Any) -> Quantization | None:
    """The layer JSON's ``quantization`` object, validated; None if absent."""
    from kvformat.errors import CorruptFileError, UnsupportedFeatureError

    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise CorruptFileError("layer 'quantization' must be an object")
    mode = obj.get("mode")
    if not isinstance(mode, str):  # a shape fault (R6); only a mode this reader lacks is a feature
        raise CorruptFileError(f"layer 'quantization' needs a string 'mode', got {mode!r}")
    if mode != "affine":
        raise UnsupportedFeatureError(f"quantization mode {mode!r}; only 'affine' is known")
    bits, group = obj.get("bits"), obj.get("group_size")
    # Outside the sets of section 6.1: a corrupt file (R6); only an unknown mode is a feature.
    if bits not in BITS or type(bits) is not int:
        raise CorruptFileError(f"quantized bits {bits!r}; the format allows {BITS}")
    if group not in GROUP_SIZES or type(group) is not int:
        raise CorruptFileError(f"quantization group size {group!r}; the format allows {GROUP_SIZES}")
    return Quantization(bits, group)
