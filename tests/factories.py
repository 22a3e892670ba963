"""One factory for the random snapshot files of the analysis tests: Gaussian K/V of a chosen
shape with the features the statistics look for (scaled channels, an attention sink, a massive
value, an outlier head), saved with `kvformat.save`. Tests compute their references from the
arrays it returns, never from constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

import kvformat


@dataclass
class RandomFile:
    """What `random_file` wrote: ``k[layer]``, ``v[layer]`` as float32 arrays of shape
    ``(heads, tokens, dim)`` (``(seqs, heads, tokens, dim)`` with several sequences), before
    the cast to the stored dtype."""

    path: Path
    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)

    def keys_by_head(self) -> list[np.ndarray]:
        """K of every (layer, head) in that order, its sequences stacked: ``(seqs x tokens, dim)``."""
        return [
            np.concatenate(list(k[:, head])) if k.ndim == 4 else k[head]
            for k in self.k
            for head in range(k.shape[-3])
        ]


def random_file(
    path: Path,
    *,
    layers: int = 1,
    heads: int = 2,
    tokens: int = 96,
    dim: int = 16,
    seqs: int = 1,
    seed: int = 0,
    dtype: Any = np.float32,
    channel_scales: np.ndarray | Literal["random"] | None = None,
    layer_scale: bool = False,
    sink: float | None = None,
    massive: float | None = None,
    spike: tuple[int, int, float] | None = None,
    outlier_head: tuple[int, float] | None = None,
    v: Literal["random", "k_prefix"] = "random",
    v_dim: int | None = None,
    v_shift: float = 0.0,
    copies: float | None = None,
    rope: bool = False,
    metadata: dict[str, Any] | None = None,
    chunk_bytes: int = 16 << 20,
) -> RandomFile:
    """Write a one-snapshot file of ``layers`` layers of ``heads`` heads, ``tokens`` tokens of
    ``dim`` channels (K), drawn from ``seed``:

    - ``channel_scales``: each K channel times these ``(dim,)`` (``"random"``: uniform 0.5-3,
      drawn per layer); ``layer_scale``: layer ``i``'s K times ``1 + i``;
    - ``sink``: position 0 of every head times this (an attention sink); ``massive``: channel 5
      at position ``tokens // 3`` of every head set to this; ``spike``: ``(head, position,
      factor)`` one row times ``factor``; ``outlier_head``: ``(head, factor)``;
    - ``v``: ``"random"`` (Gaussian plus ``v_shift``, ``v_dim`` channels, default ``dim``) or
      ``"k_prefix"`` (K's first ``v_dim`` channels);
    - ``copies``: every layer after the first is the first one's K and V times this (a scaled
      copy: linear CKA 1 across layers);
    - ``rope``: RoPE metadata over all ``dim`` channels (``"half"`` pairing) merged into
      ``metadata``.
    """
    rng = np.random.default_rng(seed)
    v_dim = dim if v_dim is None else v_dim
    shape = (seqs, heads, tokens) if seqs > 1 else (heads, tokens)
    written = RandomFile(path)
    saved = []
    for layer in range(layers):
        if copies is not None and layer:
            k, values = written.k[0] * np.float32(copies), written.v[0] * np.float32(copies)
            written.k.append(k)
            written.v.append(values)
            saved.append(kvformat.Layer(k.astype(dtype), values.astype(dtype)))
            continue
        k = rng.standard_normal((*shape, dim)).astype(np.float32)
        if isinstance(channel_scales, str):
            k *= rng.uniform(0.5, 3, dim)
        elif channel_scales is not None:
            k *= channel_scales
        if layer_scale:
            k *= 1 + layer
        if sink is not None:
            k[..., 0, :] *= sink
        if massive is not None:
            k[..., tokens // 3, 5] = massive
        if spike is not None:
            head, position, factor = spike
            k[..., head, position, :] *= factor
        if outlier_head is not None:
            head, factor = outlier_head
            k[..., head, :, :] *= factor
        if v == "k_prefix":
            values = k[..., :v_dim].copy()
        else:
            values = rng.standard_normal((*shape, v_dim)).astype(np.float32) + np.float32(v_shift)
        written.k.append(k)
        written.v.append(values)
        saved.append(kvformat.Layer(k.astype(dtype), values.astype(dtype)))
    document = dict(metadata or {})
    if rope:
        document["rope"] = {"base": 10000.0, "dims": dim, "pairing": "half", "traditional": False}
    kvformat.save(path, saved, metadata=document, chunk_bytes=chunk_bytes)
    return written
