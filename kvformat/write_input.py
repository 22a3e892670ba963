"""Checking what callers hand the writer: positions, and the rows of a head or a layer (plain
or quantized), before anything is written. Errors name the layer, head and argument."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvformat.layout import MAX_POSITION
from kvformat.manifest import LayerSpec


def as_positions(positions: Any, count: int) -> np.ndarray:
    array = positions if isinstance(positions, np.ndarray) else np.asarray(positions)
    if array.shape != (count,):
        raise ValueError(f"positions must have shape ({count},), got {array.shape}")
    if not count:
        return array.astype(np.int64, copy=False)
    if array.dtype.kind not in "iu":
        raise TypeError(f"positions must be integers, got {array.dtype}")
    array = array.astype(np.int64, copy=False)
    first, last = int(array[0]), int(array[-1])
    if first < 0 or last >= MAX_POSITION:
        raise ValueError(f"positions must lie in 0..2**53-1, got {first}..{last}")
    if count > 1 and not (array[1:] > array[:-1]).all():
        raise ValueError("positions must be strictly increasing")
    return array


def rows_of(spec: LayerSpec, where: str, data: Any, dim: int, heads: tuple[int, ...]) -> np.ndarray:
    """``data`` checked against the layer and returned as the rows stored before the codec,
    ``(*heads, n_tokens, dim)`` in the layer's dtype (possibly strided: gathered chunk by chunk
    in `Writer._prepare`), or for a quantized layer, from ``(packed, scales, biases)`` of leading
    shape ``heads``, the joined rows ``(*heads, n_tokens, row_bytes)`` uint8. ``heads``: ``()``
    for one head, ``(num_heads,)`` for a layer."""
    assert spec.dtype is not None
    leading = " x ".join(["num_heads"] * len(heads) + ["n_tokens"])
    if spec.quantization is None:
        array = np.asarray(data)
        count = array.shape[len(heads)] if array.ndim == len(heads) + 2 else -1
        if array.shape != (*heads, count, dim):
            raise ValueError(f"{where} must have shape {(*heads, 'n_tokens', dim)}, got {array.shape}")
        if array.dtype != spec.dtype.numpy:
            raise TypeError(f"{where} is {array.dtype} but the layer is {spec.dtype.name}; convert first")
        return array
    if not isinstance(data, tuple | list) or len(data) != 3:
        raise TypeError(f"{where}: a quantized layer takes (packed, scales, biases)")
    words, groups = spec.quantization.widths(dim)
    packed, scales, biases = (np.asarray(p) for p in data)
    count = packed.shape[len(heads)] if packed.ndim == len(heads) + 2 else -1
    if packed.shape != (*heads, count, words) or packed.dtype != np.uint32:
        raise ValueError(
            f"{where}: packed must be uint32 ({leading}, {words}), got {packed.dtype} {packed.shape}"
        )
    for name, part in (("scales", scales), ("biases", biases)):
        if part.shape != (*heads, count, groups) or part.dtype != spec.dtype.numpy:
            raise ValueError(
                f"{where}: {name} must be {spec.dtype.name} ({leading}, {groups}), "
                f"got {part.dtype} {part.shape}"
            )
    if not heads:
        return spec.quantization.join((packed, scales, biases))
    return np.stack([spec.quantization.join((packed[h], scales[h], biases[h])) for h in range(heads[0])])
