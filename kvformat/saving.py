"""Writing a whole snapshot at once: `save` for in-memory arrays, `write_snapshot` for a list
of appends (what capture uses). Both stream through `Writer`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat import dtypes
from kvformat.codecs import Codec
from kvformat.errors import InvalidArrayError
from kvformat.manifest import LayerSpec
from kvformat.writer import DEFAULT_CHUNK_BYTES, Writer


@dataclass
class Layer:
    """In-memory K/V of one layer for `save`.

    ``k``: ``(num_heads, n_tokens, k_dim)`` for one sequence, ``(num_seqs, num_heads, n_tokens,
    k_dim)`` for a batch, or a list of per-sequence ``(num_heads, n_i, k_dim)`` arrays (lengths may
    differ). ``v`` likewise. ``positions``: ``(n_tokens,)``, one such array per sequence, or
    ``None`` for ``0..n-1``.
    """

    k: Any
    v: Any
    positions: Any = None
    attributes: dict[str, Any] | None = None


def _per_sequence(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return list(value)
    array = np.asarray(value)
    return list(array) if array.ndim == 4 else [array]


def save(
    path: str | os.PathLike[str],
    layers: Sequence[Layer | None],
    *,
    metadata: dict[str, Any] | None = None,
    codec: str | Codec = "raw",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_seqs: int | None = None,
    overwrite: bool = False,
) -> None:
    """Write in-memory K/V as a single-snapshot file. ``None`` entries are absent layers.

    ``num_seqs`` defaults to what the arrays show (1 if every layer is absent). An existing
    ``path`` is refused unless ``overwrite=True``.
    """
    specs: list[LayerSpec | None] = []
    per_layer: list[tuple[list[Any], list[Any], list[Any]] | None] = []
    for index, layer in enumerate(layers):
        if layer is None:
            specs.append(None)
            per_layer.append(None)
            continue
        ks, vs, positions = _sequences(index, layer)
        if num_seqs is None:
            num_seqs = len(ks)
        elif num_seqs != len(ks):
            raise InvalidArrayError(f"layer {index} has {len(ks)} sequences, earlier layers {num_seqs}")
        specs.append(_layer_spec(index, layer, ks[0], vs[0]))
        per_layer.append((ks, vs, positions))
    appends = [
        (index, k, v, pos, seq)
        for index, data in enumerate(per_layer)
        if data is not None
        for seq, (k, v, pos) in enumerate(zip(*data, strict=True))
    ]
    write_snapshot(
        path,
        specs,
        appends,
        num_seqs=num_seqs or 1,
        metadata=metadata,
        codec=codec,
        chunk_bytes=chunk_bytes,
        overwrite=overwrite,
    )


def _sequences(index: int, layer: Layer) -> tuple[list[Any], list[Any], list[Any]]:
    """Layer ``index``'s K, V and positions, one entry per sequence (positions None where the
    layer gives none); `InvalidArrayError` where they disagree on the number of sequences."""
    ks, vs = _per_sequence(layer.k), _per_sequence(layer.v)
    if layer.positions is None:
        positions: list[Any] = [None] * len(ks)
    elif len(ks) == 1 and np.asarray(layer.positions).ndim == 1:
        positions = [layer.positions]
    else:
        positions = list(layer.positions)
    if not (len(ks) == len(vs) == len(positions)):
        raise InvalidArrayError(f"layer {index}: k, v and positions disagree on the number of sequences")
    return ks, vs, positions


def _layer_spec(index: int, layer: Layer, k: Any, v: Any) -> LayerSpec:
    """Layer ``index``'s `LayerSpec` from its first sequence's K and V ``(num_heads, n_tokens,
    head_dim)``."""
    first_k, first_v = np.asarray(k), np.asarray(v)
    if first_k.ndim != 3 or first_v.ndim != 3:
        raise InvalidArrayError(
            f"layer {index}: k and v must be (num_heads, n_tokens, head_dim) per sequence"
        )
    return LayerSpec(
        num_heads=first_k.shape[0],
        k_dim=first_k.shape[2],
        v_dim=first_v.shape[2],
        dtype=dtypes.from_numpy(first_k.dtype),
        attributes=dict(layer.attributes or {}),
    )


def write_snapshot(
    path: str | os.PathLike[str],
    layers: Sequence[LayerSpec | None],
    appends: Iterable[tuple[int, Any, Any, Any, int]],
    *,
    num_seqs: int = 1,
    metadata: dict[str, Any] | None = None,
    snapshot_metadata: dict[str, Any] | None = None,
    arrays: dict[str, Any] | None = None,
    codec: str | Codec = "raw",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    durable: bool = True,
    overwrite: bool = False,
) -> None:
    """Write a one-snapshot file in one go: `Writer` over ``layers``, ``appends`` as for
    `Writer.append_many` (one call, so gathering and checksumming overlap the write), one
    snapshot with ``snapshot_metadata`` and ``arrays``, then close. On any error the partial
    file is deleted: nothing half-written is left behind."""
    writer = Writer(
        path,
        layers,
        num_seqs=num_seqs,
        metadata=metadata,
        codec=codec,
        chunk_bytes=chunk_bytes,
        durable=durable,
        overwrite=overwrite,
    )
    try:
        writer.append_many(appends)
        writer.snapshot(snapshot_metadata, arrays=arrays)
        writer.close()
    except BaseException:
        writer.abort()
        with contextlib.suppress(FileNotFoundError):  # close() failed at the rename
            os.unlink(writer.partial_path)
        raise
