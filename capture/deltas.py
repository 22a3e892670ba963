"""What a live mlx-lm cache gained since the last snapshot, sliced on the device.

A series snapshot must cost what it adds, not what the cache holds: `CacheTracker` remembers, per
layer, which positions the file already has and returns only the new rows as lazy mlx slices of
the cache buffers (plus the ranges that fell out of a sliding window), so nothing proportional to
the context is copied to the host or walked in Python. Cache classes whose layout it does not know
incrementally (the batch caches) are read whole and compared on the host, as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

import kvformat
from kvformat import QUANTIZATION_BITS as QUANT_BITS
from kvformat import Quantization

from . import state as recurrent
from .caches import kv_sub_caches, read_layer, state_attributes
from .conversion import host_dtype
from .errors import CaptureError, UnsupportedModelError
from .gather import Rows

_INCREMENTAL = frozenset(
    {"KVCache", "ConcatenateKVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache"}
)


@dataclass
class LayerDelta:
    """What one layer adds to the next snapshot.

    ``drops``: position ranges ``[start, stop)`` no longer held (every sequence). New rows: on the
    device path, ``keys`` / ``values`` are mlx arrays (or `gather.Rows` of the cache buffers)
    ``(B, H, count, D)`` (a quantized layer: 3 arrays each, packed / scales / biases) at
    positions ``start .. start + count - 1`` for every sequence at ``positions`` (int64,
    increasing: the new tokens only, so O(new) to build); on the host path, ``host`` holds per
    sequence ``(k, v, positions)`` numpy data.
    """

    layer: int
    drops: list[tuple[int, int]] = field(default_factory=list)
    keys: list[mx.array | Rows] = field(default_factory=list)
    values: list[mx.array | Rows] = field(default_factory=list)
    positions: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    host: list[tuple[Any, Any, np.ndarray]] | None = None
    host_drops: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, start, stop)
    parts: int = -1  # arrays per side once `without_arrays` let them go; -1: ``len(keys)``

    @property
    def arrays_per_side(self) -> int:
        """How many arrays ``keys`` (and ``values``) hold: 1, or 3 for a quantized layer."""
        return len(self.keys) if self.parts < 0 else self.parts

    def without_arrays(self) -> LayerDelta:
        """This delta without its device arrays (once a transfer holds copies of them): a
        reference to a cache buffer kept while the snapshot is written would stop mlx from
        updating that buffer in place, so each step until then would copy the whole buffer."""
        # A constructor call, not dataclasses.replace: a snapshot makes one per layer, on the
        # generating thread, and replace costs several times more.
        return LayerDelta(
            self.layer,
            drops=self.drops,
            positions=self.positions,
            host=self.host,
            host_drops=self.host_drops,
            parts=self.arrays_per_side,
        )


@dataclass
class _Held:
    """What the file holds of one layer: positions ``[0, keep)`` plus ``[first, end)``, or for a
    host-compared layer the position arrays per sequence."""

    cache_class: str
    end: int = 0
    first: int = 0
    positions: list[np.ndarray] | None = None


def _kv_cache(cache: Any) -> Any:
    """The cache object holding K/V (the one K/V cache inside a `CacheList`)."""
    if type(cache).__name__ == "CacheList":
        kv = kv_sub_caches(cache)
        return cache.caches[kv[0]] if kv else None
    return cache


def _tail(buffer: mx.array, cache: Any, count: int) -> mx.array:
    """The last ``count`` rows, in temporal order, of a `RotatingKVCache` buffer."""
    idx, size, keep = int(cache._idx), int(buffer.shape[2]), int(cache.keep)
    if idx == size or idx >= int(cache.offset):  # temporal order already (prefill or not yet full)
        return buffer[:, :, idx - count : idx]
    # Rotated: temporal order is [0, keep), [idx, size), [keep, idx).
    recent = idx - keep
    if count <= recent:
        return buffer[:, :, idx - count : idx]
    older = count - recent
    return mx.concatenate([buffer[:, :, size - older :], buffer[:, :, keep:idx]], axis=2)


class CacheTracker:
    """Per layer of a prompt cache, the positions already written; `read` returns what is new."""

    def __init__(self) -> None:
        self._held: list[_Held | None] = []

    def read(self, prompt_cache: list[Any]) -> list[LayerDelta]:
        """The deltas of every layer since the previous call (the first call: everything)."""
        if not self._held:
            self._held = [None] * len(prompt_cache)
        if len(prompt_cache) != len(self._held):
            raise CaptureError(f"the cache has {len(prompt_cache)} layers, it had {len(self._held)}")
        deltas = []
        for index, cache in enumerate(prompt_cache):
            delta = _grown_rows(index, cache, self._held[index]) or self._read_layer(index, cache)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def end(self) -> int:
        """One past the last position any layer holds (the tokens the cache has processed)."""
        ends = [0]
        for held in self._held:
            if held is None:
                continue
            if held.positions is not None:
                ends += [int(p[-1]) + 1 for p in held.positions if p.size]
            else:
                ends.append(held.end)
        return max(ends)

    def _read_layer(self, index: int, cache: Any) -> LayerDelta | None:
        name = type(cache).__name__
        if name in recurrent.HOLDERS:
            return None  # state only: an absent layer whose state each snapshot stores
        inner = _kv_cache(cache)
        if inner is None:
            return None  # a CacheList of state only
        inner_name = type(inner).__name__
        held = self._held[index]
        if held is None:
            held = self._held[index] = _Held(inner_name)
        elif held.cache_class != inner_name:
            raise CaptureError(
                f"layer {index}: the cache changed from {held.cache_class} to {inner_name} during "
                "generation (mlx-lm quantizes the cache after quantized_kv_start tokens); start "
                "quantizing at the first token (quantized_kv_start=0) to capture a series"
            )
        if inner_name not in _INCREMENTAL:
            return self._compare_on_host(index, inner, held)
        delta = LayerDelta(index)
        keys = getattr(inner, "keys", None)
        offset = int(inner.offset)
        if keys is None:
            return None
        if offset < held.end:  # trimmed (e.g. a rejected draft): positions from offset on are gone
            delta.drops.append((offset, held.end))
            held.end = offset
        if inner_name == "RotatingKVCache":
            pieces = _rotating_pieces(inner, held, delta, offset)
        elif inner_name == "ChunkedKVCache":
            pieces = _chunked_pieces(inner, held, delta, offset)
        else:  # KVCache, ConcatenateKVCache, QuantizedKVCache: row p holds position p
            pieces = _plain_pieces(inner, held.end, offset)
        _join(delta, pieces)
        held.end = max(held.end, offset)
        return delta

    def _compare_on_host(self, index: int, cache: Any, held: _Held) -> LayerDelta:
        """A layer read whole and compared with what is held (the batch caches)."""
        layer = read_layer(cache)
        delta = LayerDelta(index, host=[])
        if held.positions is None:
            held.positions = [np.empty(0, np.int64) for _ in layer.positions]
        assert delta.host is not None
        for seq, positions in enumerate(layer.positions):
            old = held.positions[seq]
            if positions.size >= old.size and np.array_equal(positions[: old.size], old):
                first_new = old.size  # the usual case: the cache only grew
            else:
                first_new = _changed(delta, index, seq, old, positions)
            k, v = layer.tokens_from(seq, first_new)
            delta.host.append((k, v, positions[first_new:]))
            held.positions[seq] = positions
        return delta


def _changed(delta: LayerDelta, index: int, seq: int, old: np.ndarray, positions: np.ndarray) -> int:
    """For a sequence whose held positions ``old`` are not a prefix of ``positions``: record the
    dropped ranges in ``delta``, check the rest is append-only, return the first new row."""
    last = int(old[-1]) if old.size else -1
    for start, stop in _ranges(old[~np.isin(old, positions)]):
        delta.host_drops.append((seq, start, stop))
    new = positions > last
    if not np.array_equal(positions[~new], old[np.isin(old, positions)]):
        raise CaptureError(f"layer {index}: cache positions are not append-only")
    return int(np.argmax(new)) if new.any() else int(positions.size)


def _ranges(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions as half-open runs ``[start, stop)``."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [positions.size]])
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


def layer_specs(prompt_cache: list[Any]) -> tuple[list[kvformat.LayerSpec], int]:
    """Per layer the file's description (attributes, heads, dims, dtype, quantization), read from
    the cache objects without copying their data (the batch caches excepted); and the batch size."""
    specs: list[kvformat.LayerSpec] = []
    batch = 1
    for cache in prompt_cache:
        name = type(cache).__name__
        if name in recurrent.HOLDERS:  # absent: its state travels with each snapshot
            specs.append(kvformat.LayerSpec.absent(state_attributes(cache)))
            continue
        if type(_kv_cache(cache)).__name__ not in _INCREMENTAL:
            layer = read_layer(cache)  # a batch cache: its own description
            specs.append(layer.spec())
            batch = max(batch, len(layer.k))
            continue
        inner = _kv_cache(cache)
        attributes = _cache_attributes(cache, inner)
        keys = getattr(inner, "keys", None)
        if keys is None:  # nothing cached (yet, or ever: a no-op attention layer)
            specs.append(kvformat.LayerSpec.absent({**attributes, "empty": True}))
            continue
        quant, shape, dtype, k_dim, v_dim = _geometry(inner)
        batch = max(batch, int(shape[0]))
        specs.append(
            kvformat.LayerSpec(
                num_heads=int(shape[1]),
                k_dim=k_dim,
                v_dim=v_dim,
                dtype=kvformat.dtypes.from_numpy(host_dtype(dtype)),
                attributes=attributes,
                quantization=quant,
            )
        )
    return specs, batch


def _cache_attributes(cache: Any, inner: Any) -> dict[str, Any]:
    """A layer's attributes from its cache: class, kind (full, sliding with window and keep,
    chunked), and for a `CacheList` its sub-caches and which one holds K/V."""
    inner_name = type(inner).__name__
    attributes: dict[str, Any] = {"cache_class": inner_name, "kind": "full"}
    if inner_name == "RotatingKVCache":
        attributes.update(kind="sliding", window=int(inner.max_size), keep=int(inner.keep))
    elif inner_name == "ChunkedKVCache":
        attributes.update(kind="chunked", chunk_size=int(inner.chunk_size))
    if type(cache).__name__ == "CacheList":
        names = [type(c).__name__ for c in cache.caches]
        attributes.update(
            cache_class="CacheList",
            sub_caches=names,
            kv_sub_cache=names.index(inner_name),
            inner_cache_class=inner_name,
        )
        arrays_cache, arrays_index = recurrent.of(cache)
        if arrays_cache is not None:
            attributes.update(state=recurrent.describe(arrays_cache), state_sub_cache=arrays_index)
    return attributes


def _geometry(inner: Any) -> tuple[Quantization | None, Any, Any, int, int]:
    """A cache's quantization (or None), K array shape ``(batch, heads, rows, stored dim)``, stored
    dtype, and K and V head dims in elements (a quantized cache packs ``32 / bits`` per word)."""
    keys = inner.keys
    if type(inner).__name__ != "QuantizedKVCache":
        return None, keys.shape, keys.dtype, int(keys.shape[3]), int(inner.values.shape[3])
    quant = Quantization(int(inner.bits), int(inner.group_size))
    if quant.bits not in QUANT_BITS:
        raise UnsupportedModelError(f"QuantizedKVCache with {quant.bits} bits; supported: {QUANT_BITS}")
    per_word = 32 // quant.bits
    shape = keys[0].shape
    return quant, shape, keys[1].dtype, int(shape[3]) * per_word, int(inner.values[0].shape[3]) * per_word


Piece = tuple[int, int, list[Any], list[Any]]
"""New rows of a layer: (first position, count, K arrays, V arrays); several arrays for a
quantized cache (packed, scales, biases)."""


def _rotating_pieces(inner: Any, held: _Held, delta: LayerDelta, offset: int) -> list[Piece]:
    """A `RotatingKVCache`'s new rows: the kept prefix (sinks) if not yet written, then the
    window's rows past what is held; positions that left the window are dropped in ``delta``."""
    pieces: list[Piece] = []
    window = min(int(inner.keys.shape[2]), offset)
    keep = int(inner.keep)
    first = 0 if window >= offset else offset - (window - keep)
    if first > held.first:
        lost = (max(keep, held.first), min(first, held.end))
        if lost[0] < lost[1]:
            delta.drops.append(lost)
        held.first = first
    if first > keep and held.end < keep:  # the kept prefix ("sinks"), not yet written
        a = held.end
        pieces.append((a, keep - a, [inner.keys[:, :, a:keep]], [inner.values[:, :, a:keep]]))
    new_from = max(held.end, first)
    count = offset - new_from
    if count > 0:
        pieces.append(
            (new_from, count, [_tail(inner.keys, inner, count)], [_tail(inner.values, inner, count)])
        )
    return pieces


def _chunked_pieces(inner: Any, held: _Held, delta: LayerDelta, offset: int) -> list[Piece]:
    """A `ChunkedKVCache`'s new rows (row 0 holds ``start_position``); positions before its start
    are dropped in ``delta``."""
    first = int(inner.start_position)
    if first > held.first:
        lost = (held.first, min(first, held.end))
        if lost[0] < lost[1]:
            delta.drops.append(lost)
        held.first = first
    new_from = max(held.end, first)
    count = offset - new_from
    if count <= 0:
        return []
    a, b = new_from - first, offset - first
    return [(new_from, count, [inner.keys[:, :, a:b]], [inner.values[:, :, a:b]])]


def _plain_pieces(inner: Any, new_from: int, offset: int) -> list[Piece]:
    """Rows ``new_from .. offset - 1`` of a cache whose row p holds position p (quantized: each
    of packed, scales, biases)."""
    if offset <= new_from:
        return []
    count = offset - new_from
    if type(inner).__name__ == "QuantizedKVCache":
        k_parts = [x[:, :, new_from:offset] for x in inner.keys]
        v_parts = [x[:, :, new_from:offset] for x in inner.values]
        return [(new_from, count, k_parts, v_parts)]
    return [(new_from, count, [inner.keys[:, :, new_from:offset]], [inner.values[:, :, new_from:offset]])]


def _grown_rows(index: int, cache: Any, held: _Held | None) -> LayerDelta | None:
    """The common case, kept short (every layer of most models, at every snapshot): a plain
    `KVCache` read before that only grew since. Its new rows, as `_read_layer` gives them through
    `_plain_pieces` and `_join` but as `Rows`, not slices (`Transfer` copies them many
    buffers a launch on CUDA); None for anything else (another class, a first read, nothing
    new, trimmed), which `_read_layer` then reads."""
    if held is None or held.cache_class != "KVCache" or type(cache).__name__ != "KVCache":
        return None
    offset, start = int(cache.offset), held.end
    if offset <= start or cache.keys is None:
        return None
    held.end = offset
    count = offset - start
    return LayerDelta(
        index,
        keys=[Rows(cache.keys, start, count)],
        values=[Rows(cache.values, start, count)],
        positions=_positions(start, count),
    )


def _join(delta: LayerDelta, pieces: list[Piece]) -> None:
    """``delta``'s keys, values and positions from ``pieces`` (concatenated along positions)."""
    if len(pieces) == 1:
        (start, count, delta.keys, delta.values) = pieces[0]
        delta.positions = _positions(start, count)
    elif pieces:
        delta.keys = [mx.concatenate([p[2][i] for p in pieces], axis=2) for i in range(len(pieces[0][2]))]
        delta.values = [mx.concatenate([p[3][i] for p in pieces], axis=2) for i in range(len(pieces[0][3]))]
        delta.positions = np.concatenate([_positions(p[0], p[1]) for p in pieces])


@functools.lru_cache(maxsize=8)
def _positions(start: int, count: int) -> np.ndarray:
    """Positions ``start .. start + count - 1`` (int64, read-only): every layer of a snapshot
    usually adds the same ones, so they are made once."""
    positions = np.arange(start, start + count, dtype=np.int64)
    positions.flags.writeable = False
    return positions
