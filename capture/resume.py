"""Snapshots back into live mlx-lm caches, so generation can resume where it stopped."""

from __future__ import annotations

from typing import Any

import numpy as np

import kvformat
from kvformat import state as stored_state

from . import state as recurrent
from .caches import LayerKV, build_cache
from .errors import UnsupportedModelError
from .snapshot import KVSnapshot


def layers_of(snapshot: KVSnapshot | kvformat.Snapshot) -> list[LayerKV]:
    """Per-layer K/V of an in-memory snapshot or of one read back with `kvformat.open`."""
    if isinstance(snapshot, KVSnapshot):
        return snapshot.layers
    layers = []
    for index, spec in enumerate(snapshot.layers):
        data = LayerKV(attributes=dict(spec.attributes), present=spec.present, quantization=spec.quantization)
        if "state" in spec.attributes:
            described = recurrent.checked(index, spec.attributes["state"])
            data.state = _appended_state(snapshot, index, described)
            for local in recurrent.local_names(described):
                array = None if local in data.state else snapshot.array(recurrent.name(index, local))
                if array is not None:
                    data.state[local] = array
        if not spec.present:
            layers.append(data)
            continue
        read = _read_quantized if spec.quantization is not None else _read_plain
        for seq in range(snapshot.num_seqs):
            k, v, positions = read(snapshot, index, spec.num_heads, seq)
            data.k.append(k)
            data.v.append(v)
            data.positions.append(positions)
        layers.append(data)
    return layers


def _appended_state(snapshot: kvformat.Snapshot, layer: int, described: list[Any]) -> dict[str, Any]:
    """The appended slots (SPEC 15.4, ``append``) of a layer's state as the snapshot has them:
    the rows of its parent chain (the last ``last`` of them where it says so), ``(S * n, b)``
    like any stored slot."""
    out: dict[str, Any] = {}
    for slot, entry in enumerate(described):
        if entry is None or not entry.get("append"):
            continue
        (array,) = stored_state.slot_arrays(layer, slot, entry)
        found = stored_state.read(snapshot, array)
        if found is not None:
            out[recurrent.local_name(slot)] = found.reshape(found.shape[0] * found.shape[1], found.shape[2])
    return out


def _read_quantized(
    snapshot: kvformat.Snapshot, layer: int, heads: int, seq: int
) -> tuple[Any, Any, np.ndarray]:
    """One sequence of a quantized layer: K and V as ``(packed, scales, biases)`` stacked over
    heads, and the positions."""
    stored = [snapshot.quantized_head(layer, head, seq) for head in range(heads)]
    parts = [s for s in stored if s is not None]
    k = tuple(np.stack([p[0][j] for p in parts]) for j in range(3))
    v = tuple(np.stack([p[1][j] for p in parts]) for j in range(3))
    return k, v, parts[0][2]


def _read_plain(snapshot: kvformat.Snapshot, layer: int, heads: int, seq: int) -> tuple[Any, Any, np.ndarray]:
    """One sequence of a layer: K and V ``(heads, n, dim)`` and the positions."""
    read = [snapshot.head(layer, head, seq) for head in range(heads)]
    k = np.stack([h.k for h in read if h is not None])
    v = np.stack([h.v for h in read if h is not None])
    first = read[0]
    return k, v, first.positions if first is not None else np.empty(0, np.int64)


def restore(snapshot: KVSnapshot | kvformat.Snapshot) -> list[Any]:
    """An mlx-lm prompt cache (one cache object per layer) holding the snapshot's K/V and
    recurrent state; a `CacheList`'s further K/V caches come from their own file layers."""
    layers = layers_of(snapshot)
    extra: dict[int, dict[int, LayerKV]] = {}
    for data in layers:
        owner, sub = data.attributes.get("of_layer"), data.attributes.get("sub_cache")
        if owner is not None and "holds" not in data.attributes:  # a view of state: not restored
            if not (isinstance(owner, int) and isinstance(sub, int) and 0 <= owner < len(layers)):
                raise UnsupportedModelError(
                    f"a layer's of_layer {owner!r} / sub_cache {sub!r} names no layer"
                )
            extra.setdefault(owner, {})[sub] = data
    return [
        build_cache(data, extra.get(index))
        for index, data in enumerate(layers)
        if data.attributes.get("of_layer") is None
    ]


def last_logits(snapshot: KVSnapshot | kvformat.Snapshot) -> np.ndarray | None:
    """``(num_seqs, vocab)`` logits after the snapshot's last token, if it recorded them."""
    if isinstance(snapshot, KVSnapshot):
        return snapshot.last_logits
    return snapshot.array("last_logits")


def tokens_of(snapshot: KVSnapshot | kvformat.Snapshot) -> list[list[int]]:
    """Token ids per sequence whose K/V the snapshot holds (from its metadata; in a series, the
    ``tokens_appended`` of each snapshot after the last full ``tokens`` list)."""
    return [list(map(int, seq)) for seq in _resolved(snapshot, "tokens")]


def text_of(snapshot: KVSnapshot | kvformat.Snapshot) -> list[str]:
    """Decoded text per sequence so far (from its metadata, deltas resolved as for `tokens_of`)."""
    return [str(seq) for seq in _resolved(snapshot, "text")]


def _resolved(snapshot: KVSnapshot | kvformat.Snapshot, key: str) -> list[Any]:
    """Metadata ``key`` per sequence, following ``KEY_appended`` deltas back through parents."""
    deltas: list[list[Any]] = []
    current = snapshot
    while key not in current.snapshot_metadata:
        appended = current.snapshot_metadata.get(f"{key}_appended")
        if appended is None or not isinstance(current, kvformat.Snapshot) or current.parent is None:
            return []
        deltas.append(appended)
        current = current.select(current.parent)
    base = list(current.snapshot_metadata[key])
    for delta in reversed(deltas):
        if len(delta) != len(base):
            return []
        base = [old + new for old, new in zip(base, delta, strict=True)]
    return base
