"""In-memory snapshots of an mlx-lm prompt cache, and saving them as `.kv` files."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn
import numpy as np

import kvformat

from . import state as recurrent
from .caches import LayerKV, file_caches, link_extra_layers, read_layer
from .model_info import annotate_layers, file_metadata


@dataclass(frozen=True)
class HeadKV:
    """K ``(n_tokens, k_dim)``, V ``(n_tokens, v_dim)`` and positions ``(n_tokens,)`` of one head."""

    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray


@dataclass
class KVSnapshot:
    """The K/V of every layer at one moment, plus what is needed to interpret and resume it.

    Arrays are host views of one contiguous device copy of the cache (on CUDA, mlx's managed memory:
    pages move to the host as the writer reads them, overlapping the write).
    """

    layers: list[LayerKV]
    metadata: dict[str, Any] = field(default_factory=dict)
    snapshot_metadata: dict[str, Any] = field(default_factory=dict)
    last_logits: np.ndarray | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_seqs(self) -> int:
        return max((len(layer.k) for layer in self.layers if layer.present), default=1)

    @property
    def num_heads(self) -> int:
        return max((layer.dims[0] for layer in self.layers if layer.present and layer.k), default=0)

    @property
    def head_dim(self) -> int:
        return max((layer.dims[1] for layer in self.layers if layer.present and layer.k), default=0)

    @property
    def seq_len(self) -> int:
        """One past the largest position held (tokens processed)."""
        ends = [int(p[-1]) + 1 for layer in self.layers for p in layer.positions if p.size]
        return max(ends, default=0)

    def head(self, layer: int, head: int, seq: int = 0) -> HeadKV | None:
        """One head's K, V and positions, or None for a layer without K/V."""
        data = self.layers[layer]
        if not data.present or not data.k:
            return None
        k, v = data.dense(seq, head)
        return HeadKV(k, v, data.positions[seq])

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays attached to the snapshot: ``last_logits`` and every layer's recurrent
        state (SPEC 15.4)."""
        out: dict[str, np.ndarray] = {}
        if self.last_logits is not None:
            out["last_logits"] = self.last_logits
        for index, data in enumerate(self.layers):
            out.update({recurrent.name(index, local): array for local, array in data.state.items()})
        return out

    def layer_specs(self) -> list[kvformat.LayerSpec | None]:
        return [data.spec() for data in self.layers]

    def save(
        self, path: str | os.PathLike[str], codec: str = "raw", durable: bool = True, overwrite: bool = False
    ) -> None:
        """Write this snapshot as a one-snapshot `.kv` file (streamed head by head, no copy);
        ``durable=False`` skips the fsyncs; an existing ``path`` is refused unless ``overwrite``."""
        # One call for the whole cache: strided heads (mlx-lm keeps V as a strided view) are
        # gathered and checksummed on the writer's helper thread while earlier ones are written.
        kvformat.write_snapshot(
            path,
            self.layer_specs(),
            (
                (index, data.k[seq], data.v[seq], data.positions[seq], seq)
                for index, data in enumerate(self.layers)
                if data.present and data.k
                for seq in range(len(data.k))
            ),
            num_seqs=self.num_seqs,
            metadata=self.metadata,
            snapshot_metadata=self.snapshot_metadata,
            arrays=self.arrays(),
            codec=codec,
            durable=durable,
            overwrite=overwrite,
        )


def snapshot_kv(
    prompt_cache: list[Any],
    model: nn.Module | None = None,
    *,
    model_path: str | None = None,
    tokenizer: Any = None,
    tokens: list[int] | list[list[int]] | None = None,
    last_logits: Any = None,
    metadata: dict[str, Any] | None = None,
) -> KVSnapshot:
    """Take a snapshot of an mlx-lm prompt cache (one cache object per layer).

    ``tokens`` are the token ids whose K/V the cache holds (one list per sequence);
    ``last_logits`` the ``(num_seqs, vocab)`` logits after the last of them, for resuming.
    """
    layers = _described_layers(prompt_cache, model)
    info = file_metadata(model, model_path, tokenizer) if model is not None else {}
    info["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    info.update(metadata or {})
    snapshot_meta = _token_metadata(tokens, tokenizer) if tokens is not None else {}
    return KVSnapshot(layers, info, snapshot_meta, _host_logits(last_logits))


def _described_layers(prompt_cache: list[Any], model: nn.Module | None) -> list[Any]:
    """Every file layer of the cache (`caches.file_caches`) read to the host, with what the
    model says of it and a `CacheList`'s further caches linked to their owner."""
    placed = file_caches(prompt_cache, model)
    layers = [read_layer(cache) for cache, _ in placed]
    link_extra_layers([data.attributes for data in layers], [place for _, place in placed])
    annotate_layers(
        [data.attributes for data in layers],
        [data.present for data in layers],
        model,
        [data.dims[1:] if data.present and data.k else None for data in layers],
    )
    return layers


def _token_metadata(tokens: list[int] | list[list[int]], tokenizer: Any) -> dict[str, Any]:
    """``tokens`` (one list, or one per sequence) and, with a tokenizer, their text."""
    per_seq: list[Any] = list(tokens) if tokens and isinstance(tokens[0], list) else [tokens]
    meta: dict[str, Any] = {"tokens": [[int(t) for t in seq] for seq in per_seq]}
    if tokenizer is not None:
        meta["text"] = [tokenizer.decode(seq) for seq in meta["tokens"]]
    return meta


def _host_logits(last_logits: Any) -> np.ndarray | None:
    """The last logits as float32 ``(num_seqs, vocab)`` on the host, or None."""
    if last_logits is None:
        return None
    import mlx.core as mx

    from .caches import to_numpy

    array = mx.array(last_logits).astype(mx.float32)
    return to_numpy(array.reshape(-1, array.shape[-1]))
