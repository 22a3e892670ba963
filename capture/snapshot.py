"""In-memory snapshots of an mlx-lm prompt cache, and saving them as `.kv` files."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn
import numpy as np

import kvformat
from capture.caches import LayerKV, read_layer
from capture.model_info import file_metadata, latent_attributes, layer_rope_base, model_config


@dataclass(frozen=True)
class HeadKV:
    """K ``(n_tokens, k_dim)``, V ``(n_tokens, v_dim)`` and positions ``(n_tokens,)`` of one head."""

    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray


@dataclass
class KVSnapshot:
    """The K/V of every layer at one moment, plus what is needed to interpret and resume it.

    Arrays are views of the cache buffers where possible: taking a snapshot copies at most once.
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

    def layer_specs(self) -> list[kvformat.LayerSpec | None]:
        specs: list[kvformat.LayerSpec | None] = []
        for data in self.layers:
            if not data.present or not data.k:
                specs.append(kvformat.LayerSpec.absent(data.attributes))
                continue
            heads, k_dim, v_dim = data.dims
            specs.append(
                kvformat.LayerSpec(
                    num_heads=heads,
                    k_dim=k_dim,
                    v_dim=v_dim,
                    dtype=kvformat.dtypes.from_numpy(data.dtype),
                    attributes=data.attributes,
                    quantization=data.quantization,
                )
            )
        return specs

    def save(self, path: str | os.PathLike[str], codec: str = "raw", durable: bool = True) -> None:
        """Write this snapshot as a one-snapshot `.kv` file (streamed head by head, no copy);
        ``durable=False`` skips the fsyncs."""
        writer = kvformat.Writer(
            path,
            self.layer_specs(),
            num_seqs=self.num_seqs,
            metadata=self.metadata,
            codec=codec,
            durable=durable,
        )
        try:
            for layer, head, seq, k, v, positions in _gathered_heads(self.layers):
                writer.append_head(layer, head, k, v, positions, seq=seq)
            arrays = {"last_logits": self.last_logits} if self.last_logits is not None else None
            writer.snapshot(self.snapshot_metadata, arrays=arrays)
            writer.close()
        except BaseException:
            writer.abort()
            raise


_AHEAD = 2  # heads gathered ahead of the one being written


def _gathered_heads(layers: list[LayerKV]) -> Iterator[tuple[int, int, int, Any, Any, np.ndarray]]:
    """Every (layer, head, seq, k, v, positions) with K and V C-contiguous: strided heads (mlx-lm
    keeps V as a strided view) are copied on a helper thread up to `_AHEAD` heads ahead of the
    writer, into a ring of reused buffers (no allocation, so no page faults, per head), so the
    copy overlaps the write and CRC of the previous heads."""
    items = [
        (layer, head, seq, data.k[seq], data.v[seq], data.positions[seq], data.quantization is None)
        for layer, data in enumerate(layers)
        if data.present and data.k
        for seq in range(len(data.k))
        for head in range(_heads(data.k[seq], data.quantization is None))
    ]
    ring: list[dict[str, np.ndarray]] = [{} for _ in range(_AHEAD + 2)]

    def gather(i: int) -> tuple[Any, Any]:
        _, head, _, k, v, _, plain = items[i]
        if not plain:
            return tuple(np.asarray(part)[head] for part in k), tuple(np.asarray(part)[head] for part in v)
        slot = ring[i % len(ring)]
        return _contiguous(k[head], slot, "k"), _contiguous(v[head], slot, "v")

    with ThreadPoolExecutor(1, thread_name_prefix="kvsnap-gather") as pool:
        # Slots in use at once: the head being written and the _AHEAD + 1 gathered after it.
        pending = {i: pool.submit(gather, i) for i in range(min(_AHEAD + 1, len(items)))}
        for i, (layer, head, seq, _, _, positions, _) in enumerate(items):
            k, v = pending.pop(i).result()
            if i + _AHEAD + 1 < len(items):
                pending[i + _AHEAD + 1] = pool.submit(gather, i + _AHEAD + 1)
            yield layer, head, seq, k, v, positions


def _heads(k: Any, plain: bool) -> int:
    return int(np.asarray(k).shape[0] if plain else np.asarray(k[0]).shape[0])


def _contiguous(view: np.ndarray, slot: dict[str, np.ndarray], name: str) -> np.ndarray:
    """``view`` itself if C-contiguous, else a copy in the slot's reused buffer ``name``."""
    if view.flags.c_contiguous:
        return view
    buffer = slot.get(name)
    if buffer is None or buffer.nbytes < view.nbytes:
        buffer = slot[name] = np.empty(view.nbytes, np.uint8)
    out = buffer[: view.nbytes].view(view.dtype).reshape(view.shape)
    np.copyto(out, view)
    return out


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
    layers = [read_layer(cache) for cache in prompt_cache]
    info = file_metadata(model, model_path, tokenizer) if model is not None else {}
    config = model_config(model) if model is not None else {}
    latent = latent_attributes(config)
    for index, data in enumerate(layers):
        base = layer_rope_base(config, index)
        if base is not None:
            data.attributes["rope_base"] = base
        if latent is not None and data.present:
            data.attributes.update(latent)
    info["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    info.update(metadata or {})
    snapshot_meta: dict[str, Any] = {}
    if tokens is not None:
        per_seq: list[Any] = list(tokens) if tokens and isinstance(tokens[0], list) else [tokens]
        snapshot_meta["tokens"] = [[int(t) for t in seq] for seq in per_seq]
        if tokenizer is not None:
            snapshot_meta["text"] = [tokenizer.decode(seq) for seq in snapshot_meta["tokens"]]
    logits = None
    if last_logits is not None:
        import mlx.core as mx

        from capture.caches import to_numpy

        array = mx.array(last_logits).astype(mx.float32)
        logits = to_numpy(array.reshape(-1, array.shape[-1]))
    return KVSnapshot(layers, info, snapshot_meta, logits)
