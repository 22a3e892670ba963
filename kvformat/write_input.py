"""Checking what callers hand the writer: positions, and the rows of a head or a layer (plain
or quantized), before anything is written. Errors name the layer, head and argument."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvformat.errors import InvalidArgumentError, InvalidArrayError, InvalidLayoutError
from kvformat.layout import MAX_CHUNK_DECODED, MAX_POSITION
from kvformat.manifest import LayerSpec, check_head_sequences, check_pooled_layers


def as_positions(positions: Any, count: int) -> np.ndarray:
    array = positions if isinstance(positions, np.ndarray) else np.asarray(positions)
    if array.shape != (count,):
        raise InvalidArrayError(f"positions must have shape ({count},), got {array.shape}")
    if not count:
        return array.astype(np.int64, copy=False)
    if array.dtype.kind not in "iu":
        raise InvalidArrayError(f"positions must be integers, got {array.dtype}")
    array = array.astype(np.int64, copy=False)
    first, last = int(array[0]), int(array[-1])
    if first < 0 or last >= MAX_POSITION:
        raise InvalidArrayError(f"positions must lie in 0..2**53-1, got {first}..{last}")
    if count > 1 and not (array[1:] > array[:-1]).all():
        raise InvalidArrayError("positions must be strictly increasing")
    return array


def rows_of(spec: LayerSpec, where: str, data: Any, dim: int, heads: tuple[int, ...]) -> np.ndarray:
    """``data`` checked against the layer and returned as the rows stored before the codec,
    ``(*heads, n_tokens, dim)`` in the layer's dtype (possibly strided: gathered chunk by chunk
    in `Writer._prepare`), or for a quantized layer, from ``(packed, scales, biases)`` of leading
    shape ``heads``, the joined rows ``(*heads, n_tokens, row_bytes)`` uint8. ``heads``: ``()``
    for one head, ``(num_heads,)`` for a layer."""
    assert spec.dtype is not None
    if spec.quantization is None:
        return _plain_rows(spec, where, data, dim, heads)
    return _quantized_rows(spec, where, data, dim, heads)


def _plain_rows(spec: LayerSpec, where: str, data: Any, dim: int, heads: tuple[int, ...]) -> np.ndarray:
    """`rows_of` for a layer that is not quantized: the array itself, checked."""
    assert spec.dtype is not None
    array = np.asarray(data)
    count = array.shape[len(heads)] if array.ndim == len(heads) + 2 else -1
    if array.shape != (*heads, count, dim):
        raise InvalidArrayError(f"{where} must have shape {(*heads, 'n_tokens', dim)}, got {array.shape}")
    if array.dtype != spec.dtype.numpy:
        raise InvalidArrayError(f"{where} is {array.dtype} but the layer is {spec.dtype.name}; convert first")
    return array


def _quantized_rows(spec: LayerSpec, where: str, data: Any, dim: int, heads: tuple[int, ...]) -> np.ndarray:
    """`rows_of` for a quantized layer: ``(packed, scales, biases)`` checked and joined."""
    assert spec.dtype is not None and spec.quantization is not None
    leading = " x ".join(["num_heads"] * len(heads) + ["n_tokens"])
    if not isinstance(data, tuple | list) or len(data) != 3:
        raise InvalidArrayError(f"{where}: a quantized layer takes (packed, scales, biases)")
    words, groups = spec.quantization.widths(dim)
    packed, scales, biases = (np.asarray(p) for p in data)
    count = packed.shape[len(heads)] if packed.ndim == len(heads) + 2 else -1
    if packed.shape != (*heads, count, words) or packed.dtype != np.uint32:
        raise InvalidArrayError(
            f"{where}: packed must be uint32 ({leading}, {words}), got {packed.dtype} {packed.shape}"
        )
    _check_scales(spec, where, (scales, biases), (*heads, count, groups), leading)
    if not heads:
        return spec.quantization.join((packed, scales, biases))
    return np.stack([spec.quantization.join((packed[h], scales[h], biases[h])) for h in range(heads[0])])


def _check_scales(
    spec: LayerSpec, where: str, parts: tuple[np.ndarray, np.ndarray], shape: tuple[int, ...], leading: str
) -> None:
    """A quantized layer's scales and biases: the layer's dtype, ``shape``."""
    assert spec.dtype is not None
    for name, part in zip(("scales", "biases"), parts, strict=True):
        if part.shape != shape or part.dtype != spec.dtype.numpy:
            raise InvalidArrayError(
                f"{where}: {name} must be {spec.dtype.name} ({leading}, {shape[-1]}), "
                f"got {part.dtype} {part.shape}"
            )


def checked_layout(layers: Sequence[LayerSpec | None], num_seqs: int, chunk_bytes: int) -> list[LayerSpec]:
    """The writer's layer specs (None: an absent layer), each checked, with the sequence count
    and chunk size a writer may declare."""
    specs = [layer if layer is not None else LayerSpec.absent() for layer in layers]
    for spec in specs:
        spec.check()
    if not isinstance(num_seqs, int) or num_seqs < 1:
        raise InvalidArgumentError(f"num_seqs must be a positive integer, got {num_seqs!r}")
    check_head_sequences(specs, num_seqs, InvalidLayoutError)
    check_pooled_layers(specs)
    if not 1 <= chunk_bytes <= MAX_CHUNK_DECODED:
        raise InvalidArgumentError(f"chunk_bytes must be in 1..{MAX_CHUNK_DECODED}")
    return specs


def block_start(positions: Any, count: int, start: int | None) -> int | None:
    """The first position of ``count`` consecutive rows: ``start`` (checked against the position
    limit) or the first of ``positions``; None when ``positions`` has gaps (one chunk per run)."""
    if start is not None:
        if count and not 0 <= start <= MAX_POSITION - count:
            raise InvalidArrayError(f"positions must lie in 0..2**53-1, got {start}..{start + count - 1}")
        return start
    pos = as_positions(positions, count)
    if count and int(pos[-1]) - int(pos[0]) != count - 1:
        return None
    return int(pos[0]) if count else 0


def plain_arrays(spec: LayerSpec, k: Any, v: Any) -> bool:
    """``k`` and ``v`` are C-contiguous numpy arrays ``(num_heads, n, dim)`` of the layer's
    unquantized dtype: storable as they are."""
    if spec.quantization is not None or spec.dtype is None:
        return False
    if type(k) is not np.ndarray or type(v) is not np.ndarray:
        return False
    if not (k.flags.c_contiguous and v.flags.c_contiguous) or k.ndim != 3 or v.ndim != 3:
        return False
    tokens = k.shape[1]
    shapes = (k.shape, v.shape) == (
        (spec.num_heads, tokens, spec.k_dim),
        (spec.num_heads, tokens, spec.v_dim),
    )
    return shapes and k.dtype == v.dtype == spec.dtype.numpy


def input_bytes(array: Any) -> int:
    """Bytes of an appended array, or of a quantized ``(packed, scales, biases)`` tuple."""
    if isinstance(array, tuple):
        return sum(input_bytes(part) for part in array)
    return int(getattr(array, "nbytes", 0))


def owned_copy(array: Any) -> Any:
    """A copy `append` may keep until it writes (the caller may reuse its buffer at once);
    C-contiguous, so small chunks are gathered into one buffer later."""
    if isinstance(array, tuple):
        return tuple(owned_copy(part) for part in array)
    return np.array(array, copy=True, order="C") if isinstance(array, np.ndarray) else array
