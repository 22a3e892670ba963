"""Undo RoPE offline: recover pre-RoPE keys from post-RoPE keys, their positions and the RoPE
description a snapshot records (``metadata["rope"]`` plus a layer's ``rope_base``).

RoPE rotates pair ``i`` of a key at position ``p`` by ``theta_i = p * scale * base^(-2i/dims)``;
pairs are ``(2i, 2i+1)`` ("interleaved", mlx ``traditional=True``) or ``(i, i + dims/2)``
("half"). Channels past ``dims`` are not rotated. Rotations are orthogonal, so the inverse is
exact up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat import gguf_channel_order

from ..errors import AnalysisError


class RopeError(AnalysisError):
    """The snapshot does not describe its RoPE well enough to undo it."""


@dataclass(frozen=True)
class Rope:
    """RoPE parameters: ``base``, rotary ``dims``, ``pairing``, position ``scale``."""

    base: float
    dims: int
    pairing: str
    scale: float = 1.0

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], attributes: dict[str, Any], head_dim: int) -> Rope:
        rope = metadata.get("rope")
        if not isinstance(rope, dict):
            raise RopeError("the snapshot's metadata has no 'rope' description; cannot undo RoPE")
        pairing = rope.get("pairing")
        if pairing not in ("interleaved", "half"):
            raise RopeError(f"unknown RoPE pairing {pairing!r}")
        scale = 1.0
        scaling = rope.get("scaling")
        if scaling:
            kind = scaling.get("type") or scaling.get("rope_type")
            if kind != "linear":
                raise RopeError(f"RoPE scaling {kind!r} is not invertible here (only 'linear')")
            scale = 1.0 / float(scaling["factor"])
        if attributes.get("kind") == "latent":
            raise RopeError("latent (MLA) layers store no per-head keys to un-rotate")
        dims = int(rope.get("dims") or head_dim)
        base = float(attributes.get("rope_base") or rope.get("base") or 10000.0)
        return cls(base, min(dims, head_dim), pairing, scale)

    def angles(self, positions: np.ndarray) -> np.ndarray:
        """``(n, dims/2)`` rotation angles in float64."""
        inv_freq = self.base ** (-np.arange(0, self.dims, 2, dtype=np.float64) / self.dims)
        return (positions.astype(np.float64) * self.scale)[:, None] * inv_freq[None, :]

    def _pairs(self) -> tuple[slice | np.ndarray, slice | np.ndarray]:
        if self.pairing == "interleaved":
            return slice(0, self.dims, 2), slice(1, self.dims, 2)
        half = self.dims // 2
        return slice(0, half), slice(half, self.dims)

    def rotate(self, x: np.ndarray, positions: np.ndarray, inverse: bool = False) -> np.ndarray:
        """Apply (or undo) RoPE to ``x`` ``(n, head_dim)``; returns float32."""
        out = np.array(x, dtype=np.float32, copy=True)
        theta = self.angles(positions)
        cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
        if inverse:
            sin = -sin
        first, second = self._pairs()
        a, b = out[:, first].copy(), out[:, second].copy()
        out[:, first] = a * cos - b * sin
        out[:, second] = a * sin + b * cos
        return out

    def pair_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """Channel indices ``(first, second)`` of each rotary pair, ``(dims/2,)`` each."""
        channels = np.arange(self.dims)
        first, second = self._pairs()
        return channels[first], channels[second]

    def pair_energy(self, x: np.ndarray) -> np.ndarray:
        """``(dims/2,)`` sum over rows of the squared norm of each rotary pair (RoPE-invariant)."""
        first, second = self._pairs()
        xf = np.asarray(x, dtype=np.float64)
        return (xf[:, first] ** 2 + xf[:, second] ** 2).sum(axis=0)


def interleaved_to_half(k: np.ndarray, dims: int) -> np.ndarray:
    """``k`` ``(..., head_dim)`` whose first ``dims`` channels pair RoPE dimensions as
    ``(2i, 2i+1)`` reordered to pair them as ``(i, i + dims/2)``: channel ``i`` is the old
    ``2i``, channel ``i + dims/2`` the old ``2i + 1``; channels past ``dims`` stay. For a GGUF
    conversion that kept llama.cpp's permutation, this is the checkpoint's order. A copy."""
    order = np.concatenate([np.arange(0, dims, 2), np.arange(1, dims, 2), np.arange(dims, k.shape[-1])])
    return np.asarray(k)[..., order]


def checkpoint_keys(snap: Any, layer: int, head: int, seq: int = 0) -> np.ndarray | None:
    """K ``(n_tokens, k_dim)`` of one head of an open snapshot in the checkpoint's channel order:
    reordered (`interleaved_to_half`) for a file in llama.cpp's GGUF order (`gguf_channel_order`),
    as stored otherwise. None for an absent layer. Positions: ``snap.head(...).positions``."""
    data = snap.head(layer, head, seq)
    if data is None:
        return None
    if not gguf_channel_order(snap.metadata):
        return np.asarray(data.k)
    rope = Rope.from_metadata(snap.metadata, snap.layers[layer].attributes, snap.layers[layer].k_dim)
    return interleaved_to_half(data.k, rope.dims)
