"""mlx-lm cache objects <-> per-layer K/V in temporal order with absolute positions.

`read_layer` turns one layer's cache into a `LayerKV` (zero-copy views where the cache allows);
`build_cache` turns stored K/V back into a live cache of the same class. Every cache class of
``mlx_lm.models.cache`` is either handled or refused with an error naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kvformat import QUANTIZATION_BITS as QUANT_BITS
from kvformat import LayerSpec, Quantization, dtypes

from . import state as recurrent
from .conversion import to_mlx, to_numpy
from .errors import UnsupportedModelError


@dataclass
class LayerKV:
    """One layer's cache contents in temporal order.

    ``k``: per sequence ``(num_heads, n_tokens, k_dim)`` numpy arrays (views of mlx buffers where
    possible), ``v`` likewise, ``positions``: per sequence ``(n_tokens,)`` int64. ``present`` is
    False for layers holding no K/V (recurrent state); ``attributes`` describe the cache.
    """

    k: list[Any] = field(default_factory=list)
    v: list[Any] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)
    present: bool = True
    quantization: Quantization | None = None
    state: dict[str, np.ndarray] = field(default_factory=dict)
    """Recurrent state ``(rows, width)`` arrays by their name within the layer
    (`capture.state.local_name`); the ``state`` attribute describes them."""

    def tokens_from(self, seq: int, start: int) -> tuple[Any, Any]:
        """K and V of one sequence from token index ``start`` on (parts sliced alike)."""
        if self.quantization is not None:
            return (tuple(p[:, start:] for p in self.k[seq]), tuple(p[:, start:] for p in self.v[seq]))
        return self.k[seq][:, start:], self.v[seq][:, start:]

    def dense(self, seq: int, head: int) -> tuple[np.ndarray, np.ndarray]:
        """Dequantized (if needed) K ``(n, k_dim)`` and V ``(n, v_dim)`` of one head."""
        if self.quantization is None:
            return self.k[seq][head], self.v[seq][head]
        dtype = self.k[seq][1].dtype
        k = self.quantization.dequantize(tuple(p[head] for p in self.k[seq]), dtype)
        v = self.quantization.dequantize(tuple(p[head] for p in self.v[seq]), dtype)
        return k, v

    @property
    def dims(self) -> tuple[int, int, int]:
        """(num_heads, k_dim, v_dim)."""
        if self.quantization is None:
            return self.k[0].shape[0], self.k[0].shape[2], self.v[0].shape[2]
        per_word = 32 // self.quantization.bits
        return self.k[0][0].shape[0], self.k[0][0].shape[2] * per_word, self.v[0][0].shape[2] * per_word

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.k[0][1].dtype if self.quantization is not None else self.k[0].dtype)

    def spec(self) -> LayerSpec:
        """The file's description of this layer (absent if it holds no K/V)."""
        if not self.present or not self.k:
            return LayerSpec.absent(self.attributes)
        heads, k_dim, v_dim = self.dims
        return LayerSpec(
            num_heads=heads,
            k_dim=k_dim,
            v_dim=v_dim,
            dtype=dtypes.from_numpy(self.dtype),
            attributes=self.attributes,
            quantization=self.quantization,
        )


def _split(keys: mx.array, values: mx.array, positions: np.ndarray, attributes: dict[str, Any]) -> LayerKV:
    """``keys``: ``(B, H, n, D)`` in temporal order; the same positions for every sequence."""
    keys, values = _host_ready(keys), _host_ready(values)
    mx.eval(keys, values)
    k, v = to_numpy(keys), to_numpy(values)
    batch = k.shape[0]
    return LayerKV(
        [k[b] for b in range(batch)], [v[b] for b in range(batch)], [positions] * batch, attributes
    )


def unified_memory() -> bool:
    """Whether the host reads mlx arrays where they lie (the CPU backend, Apple silicon): then a
    numpy view of a cache slice is free and the writer gathers strided rows itself. On CUDA it is
    not (managed memory: every page the host touches migrates)."""
    return mx.default_device().type == mx.DeviceType.cpu or mx.metal.is_available()


def _host_ready(array: mx.array) -> mx.array:
    """``array`` as the host should read it: as it is with unified memory; otherwise copied into a
    contiguous buffer on the device first (one device pass, a few ms for an 8B model's 8k-token
    cache), so the host copies only those bytes, not the pages of the whole cache."""
    return array if unified_memory() else mx.contiguous(array)


def _evaluated(arrays: Any) -> Any:
    sliced = list(arrays)
    mx.eval(sliced)
    return sliced


def _rotating_positions(offset: int, held: int, keep: int) -> np.ndarray:
    """Positions of a rotating cache holding ``held`` slots after ``offset`` tokens."""
    if held >= offset:
        return np.arange(offset, dtype=np.int64)
    tail = held - keep
    return np.concatenate([np.arange(keep), np.arange(offset - tail, offset)]).astype(np.int64)


def read_layer(cache: Any) -> LayerKV:
    """The K/V one mlx-lm cache object holds, for any cache class mlx-lm defines (`CACHE_CLASSES`)."""
    name = type(cache).__name__
    kind = CACHE_CLASSES.get(name)
    if kind is None:
        raise UnsupportedModelError(f"cache class {name} is not supported by kvsnap capture")
    attributes: dict[str, Any] = {"cache_class": name}
    if kind.holds_kv and getattr(cache, "keys", None) is None:  # nothing cached (yet, or ever)
        attributes.update(kind="full", empty=True)
        if name == "RotatingKVCache":
            attributes.update(kind="sliding", window=int(cache.max_size), keep=int(cache.keep))
        elif name == "ChunkedKVCache":
            attributes.update(kind="chunked", chunk_size=int(cache.chunk_size))
        return LayerKV(attributes=attributes, present=True)
    return kind.read(cache, attributes)


def state_attributes(cache: Any) -> dict[str, Any]:
    """The attributes of a layer whose cache is stored as state (`capture.state.HOLDERS`): an
    `ArraysCache` (recurrent: SSM / linear-attention state, not K/V), or deepseek_v41's own
    `LayerCache` (a sliding window, compressed groups and their index keys, the open group's rows:
    all of it, with the module defining the class and its window size, so restore builds the same
    class). ``state`` describes the arrays stored beside the layer; nothing is copied."""
    attributes: dict[str, Any] = {"cache_class": type(cache).__name__, "state": recurrent.describe(cache)}
    if type(cache).__name__ == "LayerCache":
        attributes.update(
            kind="compressed", cache_module=type(cache).__module__, window_size=int(cache.window_size)
        )
    else:
        attributes["kind"] = "recurrent"
    return attributes


def _read_state(cache: Any, attributes: dict[str, Any]) -> LayerKV:
    """A cache stored as state: an absent layer (`state_attributes`) and its arrays on the host."""
    layer = LayerKV(attributes={**attributes, **state_attributes(cache)}, present=False)
    layer.state = recurrent.host_arrays(-1, cache, layer.attributes["state"])
    return layer


def _build_layer_cache(layer: LayerKV, name: str) -> Any:
    import importlib
    import re

    module = layer.attributes.get("cache_module")
    if not isinstance(module, str) or not re.fullmatch(r"mlx_lm\.models\.[a-z0-9_]+", module):
        raise UnsupportedModelError(
            f"LayerCache of module {module!r}: only mlx-lm's model modules are restored"
        )
    cls = getattr(importlib.import_module(module), "LayerCache", None)
    described = layer.attributes.get("state")
    if cls is None or not isinstance(described, list):
        raise UnsupportedModelError(f"{module} defines no LayerCache, or the layer holds no state")
    return recurrent.restore_layer_cache(
        cls, _setting(layer, "window_size"), recurrent.values(described, layer.state.get)
    )


def _read_cache_list(cache: Any, attributes: dict[str, Any]) -> LayerKV:
    """A CacheList: its K/V cache as the layer's K/V and its `ArraysCache` as state; the
    attributes name every sub-cache and which one holds what."""
    inner = [type(c).__name__ for c in cache.caches]
    kv = kv_sub_caches(cache)
    arrays_cache, arrays_index = recurrent.of(cache)
    if kv:
        layer = read_layer(cache.caches[kv[0]])
    else:
        layer = LayerKV(attributes={"kind": "recurrent"}, present=False)
    layer.attributes.update({"cache_class": "CacheList", "sub_caches": inner})
    if kv:
        layer.attributes.update(kv_sub_cache=kv[0], inner_cache_class=inner[kv[0]])
    if arrays_cache is not None:
        described = recurrent.describe(arrays_cache)
        layer.attributes.update(state=described, state_sub_cache=arrays_index)
        layer.state = recurrent.host_arrays(-1, arrays_cache, described)
    return layer


def kv_sub_caches(cache: Any) -> list[int]:
    """Which sub-caches of a `CacheList` hold K/V (the first is the layer's own; each other one
    becomes a file layer of its own, `file_caches`); anything else than K/V caches and one
    `ArraysCache` is refused by name."""
    inner = [type(c).__name__ for c in cache.caches]
    unknown = [c for c in inner if c not in CACHE_CLASSES or c == "CacheList"]
    if unknown or inner.count("ArraysCache") > 1:
        raise UnsupportedModelError(
            f"CacheList of {inner}: K/V caches and one ArraysCache per layer can be captured"
        )
    return [i for i, c in enumerate(inner) if CACHE_CLASSES[c].holds_kv]


def file_caches(prompt_cache: list[Any], model: Any = None) -> list[tuple[Any, dict[str, Any]]]:
    """The cache object behind every layer of the file, with the attributes that place it: the
    model's caches in order (layer ``i`` of the file is the model's cache ``i``), then every
    further K/V cache of a `CacheList` (a sparse-attention indexer's keys, a second attention
    block), as a file layer of its own with ``of_layer`` and ``sub_cache`` (SPEC 15.2), then,
    with the ``model``, the keys a deepseek_v41 `LayerCache` holds as state (`key_views`)."""
    layers: list[tuple[Any, dict[str, Any]]] = [(cache, {}) for cache in prompt_cache]
    for index, cache in enumerate(prompt_cache):
        if type(cache).__name__ == "CacheList":
            for sub in kv_sub_caches(cache)[1:]:
                layers.append((cache.caches[sub], {"of_layer": index, "sub_cache": sub}))
    return layers + key_views(prompt_cache, model)


def compressed_attention(model: Any) -> list[Any]:
    """Per layer, deepseek_v41's attention module (compressed sparse attention over a
    `LayerCache`), or an empty list for a model of another architecture."""
    layers = getattr(model, "layers", None) if model is not None else None
    modules = [getattr(layer, "self_attn", None) for layer in layers or []]
    if not modules or any(type(m).__module__ != "mlx_lm.models.deepseek_v41" for m in modules):
        return []
    return modules


def key_views(prompt_cache: list[Any], model: Any) -> list[tuple[Any, dict[str, Any]]]:
    """deepseek_v41's keys as K/V file layers (SPEC 15.2, ``holds``), made anew from the layer
    caches at each call (no copy: views of their arrays): for every layer, its sliding window's
    rows as a `RotatingKVCache` of one head, K = V, at token positions (``holds: "window"``); for
    every layer that pools its own keys, its closed groups as a `KVCache` of one head, K = V, at
    group positions (``holds: "compress_kv"``, ``ratio``: token positions per group). Attention
    from the file reads them (a query's window, and the groups its indexer chose)."""
    modules = compressed_attention(model)
    if not modules or len(modules) != len(prompt_cache):
        return []
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    views: list[tuple[Any, dict[str, Any]]] = []
    pooled: list[tuple[Any, dict[str, Any]]] = []
    for index, (cache, module) in enumerate(zip(prompt_cache, modules, strict=True)):
        window = getattr(cache, "window", None)
        if type(cache).__name__ != "LayerCache" or window is None:
            return []  # before the first step: nothing to describe yet
        rows = window[:, None]  # (batch, 1 head, rows, head_dim)
        view = RotatingKVCache(max_size=int(cache.window_size), keep=0)
        view.keys, view.values, view.offset = rows, rows, int(cache.offset)
        view._idx = int(rows.shape[2])  # its rows in temporal order
        views.append((view, {"of_layer": index, "holds": "window"}))
        if getattr(module, "is_kv_source", False) and int(getattr(module, "ratio", 0)) > 0:
            groups = cache.compress_kv
            empty = (*rows.shape[:2], 0, rows.shape[3])  # no group closed yet
            keys = groups[:, None] if groups is not None else mx.zeros(empty, rows.dtype)
            whole = KVCache()
            whole.keys, whole.values, whole.offset = keys, keys, int(keys.shape[2])
            place = {"of_layer": index, "holds": "compress_kv", "ratio": int(module.ratio), "kind": "pooled"}
            pooled.append((whole, place))
    return views + pooled


def link_extra_layers(attributes: list[dict[str, Any]], placed: list[dict[str, Any]]) -> None:
    """Record, in place, where each further K/V cache of a `CacheList` went: ``extra_layers``
    (``[[sub_cache, file layer], ...]``) on its model layer, ``of_layer`` and ``sub_cache`` on
    the file layer (``placed`` is `file_caches`'s second member per layer); a view of a layer's
    state (``holds``) is placed likewise, its owner listing it in ``key_layers``."""
    for index, place in enumerate(placed):
        if place:
            attributes[index].update(place)
            owner = attributes[place["of_layer"]]
            if "sub_cache" in place:
                owner.setdefault("extra_layers", []).append([place["sub_cache"], index])
            else:
                owner.setdefault("key_layers", []).append([place["holds"], index])


def _read_full(cache: Any, attributes: dict[str, Any]) -> LayerKV:
    offset = int(cache.offset)
    keys, values = cache.keys[..., :offset, :], cache.values[..., :offset, :]
    return _split(keys, values, np.arange(offset, dtype=np.int64), {**attributes, "kind": "full"})


def _read_rotating(cache: Any, attributes: dict[str, Any]) -> LayerKV:
    keys, values = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    held = min(int(keys.shape[2]), int(cache.offset))
    keys, values = keys[..., :held, :], values[..., :held, :]
    positions = _rotating_positions(int(cache.offset), held, int(cache.keep))
    attrs = {**attributes, "kind": "sliding", "window": int(cache.max_size), "keep": int(cache.keep)}
    return _split(keys, values, positions, attrs)


def _read_chunked(cache: Any, attributes: dict[str, Any]) -> LayerKV:
    start, end = int(cache.start_position), int(cache.offset)
    keys, values = cache.keys[..., : end - start, :], cache.values[..., : end - start, :]
    attrs = {**attributes, "kind": "chunked", "chunk_size": int(cache.chunk_size)}
    return _split(keys, values, np.arange(start, end, dtype=np.int64), attrs)


def _read_quantized(cache: Any, attributes: dict[str, Any]) -> LayerKV:
    offset = int(cache.offset)
    quant = Quantization(int(cache.bits), int(cache.group_size))
    if quant.bits not in QUANT_BITS:
        raise UnsupportedModelError(f"QuantizedKVCache with {quant.bits} bits; supported: {QUANT_BITS}")
    k_parts = [to_numpy(x) for x in _evaluated(_host_ready(x[..., :offset, :]) for x in cache.keys)]
    v_parts = [to_numpy(x) for x in _evaluated(_host_ready(x[..., :offset, :]) for x in cache.values)]
    batch = k_parts[0].shape[0]
    positions = np.arange(offset, dtype=np.int64)
    return LayerKV(
        [tuple(x[b] for x in k_parts) for b in range(batch)],
        [tuple(x[b] for x in v_parts) for b in range(batch)],
        [positions] * batch,
        {**attributes, "kind": "full"},
        quantization=quant,
    )


def _read_batch(cache: Any, attributes: dict[str, Any]) -> LayerKV:
    """Each sequence of a BatchKVCache without its left padding."""
    mx.eval(cache.keys, cache.values, cache.left_padding)
    end = int(cache._idx)
    padding = np.asarray(cache.left_padding).tolist()
    k, v = to_numpy(cache.keys[..., :end, :]), to_numpy(cache.values[..., :end, :])
    out = LayerKV(attributes={**attributes, "kind": "full", "left_padding": padding})
    for b, pad in enumerate(padding):
        out.k.append(k[b, :, pad:end])
        out.v.append(v[b, :, pad:end])
        out.positions.append(np.arange(end - pad, dtype=np.int64))
    return out


def _read_batch_rotating(cache: Any, attributes: dict[str, Any]) -> LayerKV:
    """Per-sequence windows of a BatchRotatingKVCache, without changing the cache."""
    keys, values = cache.keys, cache.values
    if cache.rotated:
        keys, values = mx.roll(keys, -cache._idx, 2), mx.roll(values, -cache._idx, 2)
    else:
        keys, values = keys[..., : cache._idx, :], values[..., : cache._idx, :]
    mx.eval(keys, values, cache.left_padding, cache.offset)
    k, v = to_numpy(keys), to_numpy(values)
    slots = k.shape[2]
    padding = np.asarray(cache.left_padding).tolist()
    offsets = np.asarray(cache.offset).tolist()
    out = LayerKV(attributes={**attributes, "kind": "sliding", "window": int(cache.max_size), "keep": 0})
    for b, (pad, offset) in enumerate(zip(padding, offsets, strict=True)):
        first = max(int(pad), 0)
        count = min(slots - first, int(offset))
        first = slots - count
        out.k.append(k[b, :, first:])
        out.v.append(v[b, :, first:])
        out.positions.append(np.arange(int(offset) - count, int(offset), dtype=np.int64))
    return out


def build_cache(layer: LayerKV, extra: dict[int, LayerKV] | None = None) -> Any:
    """A live mlx-lm cache holding ``layer`` (the inverse of `read_layer`; `CACHE_CLASSES` says
    which classes can be rebuilt); ``extra``: a `CacheList`'s further K/V caches by sub-cache
    index, read from their own file layers."""
    name = layer.attributes.get("cache_class", "KVCache")
    if name == "CacheList":
        return _build_cache_list(layer, extra or {})
    if name == "ArraysCache":
        return _build_arrays(layer)
    if name == "LayerCache":
        return _build_layer_cache(layer, name)
    if not layer.present:
        return _build_empty(layer, name)
    _check_restorable(layer)
    if layer.quantization is not None:
        name = "QuantizedKVCache"  # whatever class wrote it: quantized data goes back quantized
    kind = CACHE_CLASSES.get(name)
    if kind is None or kind.build is None:
        raise UnsupportedModelError(f"restoring cache class {name} is not supported")
    return kind.build(layer, name)


def _check_restorable(layer: LayerKV) -> None:
    """`UnsupportedModelError` for a present layer with no sequence, or sequences at different
    positions (a cache holds one position list)."""
    if not layer.k:
        raise UnsupportedModelError("layer without sequences cannot be restored")
    if any(not np.array_equal(p, layer.positions[0]) for p in layer.positions):
        raise UnsupportedModelError("sequences of a batch hold different positions; restore one sequence")


def _setting(layer: LayerKV, key: str, default: int | None = None) -> int:
    """A cache setting the layer's attributes record (a window, a chunk size): a non-negative
    integer, or `UnsupportedModelError` naming it (a file's attributes are input)."""
    value = layer.attributes.get(key, default)
    if type(value) is not int or not 0 <= value < 2**53 or (value == 0 and default is None):
        raise UnsupportedModelError(
            f"the layer's attribute {key!r} is {value!r}, not the {layer.attributes.get('cache_class')} "
            "setting capture writes; it cannot be restored"
        )
    return value


def _build_empty(layer: LayerKV, name: str) -> Any:
    """A K/V cache that held nothing when the snapshot was taken (a layer whose attention is a
    no-op or a linear map, as in nemotron-nas, never fills its cache): a new one of its class."""
    from mlx_lm.models import cache as cache_module

    if name == "RotatingKVCache":
        return cache_module.RotatingKVCache(
            max_size=_setting(layer, "window"), keep=_setting(layer, "keep", 0)
        )
    if name == "ChunkedKVCache":
        return cache_module.ChunkedKVCache(_setting(layer, "chunk_size"))
    if name in ("KVCache", "ConcatenateKVCache"):
        return getattr(cache_module, name)()
    raise UnsupportedModelError(f"layer of class {name} holds no K/V in the snapshot; it cannot be restored")


def _build_arrays(layer: LayerKV) -> Any:
    described = layer.attributes.get("state")
    if not isinstance(described, list):
        raise UnsupportedModelError(
            "this ArraysCache layer was captured without its recurrent state (a file written before "
            "state was stored); it cannot be restored"
        )
    return recurrent.rebuild(described, layer.state.get)


def _build_cache_list(layer: LayerKV, extra: dict[int, LayerKV]) -> Any:
    """The `CacheList` a layer came from, each sub-cache rebuilt in its place."""
    from mlx_lm.models.cache import CacheList

    attributes = layer.attributes
    names = attributes.get("sub_caches")
    if not isinstance(names, list) or "not_stored" in attributes:
        raise UnsupportedModelError(
            f"this layer's CacheList also held {attributes.get('not_stored')}, which the snapshot does "
            "not store; it cannot be restored"
        )
    caches: list[Any] = []
    for index, sub in enumerate(names):
        if index == attributes.get("kv_sub_cache"):
            caches.append(build_cache(_sub_layer(layer, sub)))
        elif index == attributes.get("state_sub_cache"):
            caches.append(_build_arrays(layer))
        elif index in extra:
            caches.append(build_cache(extra[index]))
        else:
            raise UnsupportedModelError(
                f"CacheList sub-cache {index} ({sub}) is not stored; it cannot be restored"
            )
    return CacheList(*caches)


def _sub_layer(layer: LayerKV, name: str) -> LayerKV:
    """The K/V part of a `CacheList` layer, as the layer of its own class."""
    attributes = {k: v for k, v in layer.attributes.items() if k not in ("sub_caches", "state")}
    attributes["cache_class"] = name
    return LayerKV(layer.k, layer.v, layer.positions, attributes, layer.present, layer.quantization)


def _positions_from_zero(layer: LayerKV, name: str) -> int:
    """The token count of a layer that must hold positions 0..n-1 (UnsupportedModelError if not)."""
    positions = layer.positions[0]
    n = int(positions.size)
    if not np.array_equal(positions, np.arange(n)):
        raise UnsupportedModelError(f"{name} needs positions 0..n-1; this layer holds others")
    return n


def _stacked(tensors: list[Any]) -> mx.array:
    return to_mlx(np.stack([np.asarray(x) for x in tensors]))


def _build_quantized(layer: LayerKV, name: str) -> Any:
    from mlx_lm.models import cache as cache_module

    n = _positions_from_zero(layer, name)
    assert layer.quantization is not None
    quantization = layer.quantization
    cache = cache_module.QuantizedKVCache(group_size=quantization.group_size, bits=quantization.bits)
    if n:
        keys, values = (
            tuple(to_mlx(np.stack([np.asarray(parts[j]) for parts in group])) for j in range(3))
            for group in (layer.k, layer.v)
        )
        cache.keys, cache.values = keys, values  # type: ignore[assignment]
    cache.offset = n
    return cache


def _build_full(layer: LayerKV, name: str) -> Any:
    from mlx_lm.models import cache as cache_module

    n = _positions_from_zero(layer, name)
    cache = getattr(cache_module, name)()
    if n:
        cache.keys, cache.values, cache.offset = _stacked(layer.k), _stacked(layer.v), n
    return cache


def _build_rotating(layer: LayerKV, name: str) -> Any:
    from mlx_lm.models import cache as cache_module

    positions = layer.positions[0]
    n = int(positions.size)
    window, keep = _setting(layer, "window"), _setting(layer, "keep", 0)
    cache = cache_module.RotatingKVCache(max_size=window, keep=keep)
    if n:
        offset = int(positions[-1]) + 1
        if not np.array_equal(positions, _rotating_positions(offset, n, keep)):
            raise UnsupportedModelError("rotating layer positions are not keep-prefix + window")
        cache.keys, cache.values = _stacked(layer.k), _stacked(layer.v)
        cache.offset, cache._idx = offset, n
    return cache


def _build_chunked(layer: LayerKV, name: str) -> Any:
    from mlx_lm.models import cache as cache_module

    positions = layer.positions[0]
    cache = cache_module.ChunkedKVCache(_setting(layer, "chunk_size"))
    if positions.size:
        cache.keys, cache.values = _stacked(layer.k), _stacked(layer.v)
        cache.offset, cache.start_position = int(positions[-1]) + 1, int(positions[0])
    return cache


@dataclass(frozen=True)
class CacheClass:
    """How kvsnap handles one mlx-lm cache class: ``read`` it into a `LayerKV` (given the class
    attributes), ``build`` one back from a `LayerKV` (None: captured but not restorable), and
    whether it ``holds_kv`` (a K/V cache, as opposed to recurrent state or a list of caches)."""

    read: Callable[[Any, dict[str, Any]], LayerKV]
    build: Callable[[LayerKV, str], Any] | None
    holds_kv: bool = True


CACHE_CLASSES: dict[str, CacheClass] = {
    "KVCache": CacheClass(_read_full, _build_full),
    "ConcatenateKVCache": CacheClass(_read_full, _build_full),
    "RotatingKVCache": CacheClass(_read_rotating, _build_rotating),
    "ChunkedKVCache": CacheClass(_read_chunked, _build_chunked),
    "QuantizedKVCache": CacheClass(_read_quantized, _build_quantized),
    "BatchKVCache": CacheClass(_read_batch, None),  # restore one sequence of it instead
    "BatchRotatingKVCache": CacheClass(_read_batch_rotating, None),
    "ArraysCache": CacheClass(_read_state, None, holds_kv=False),
    "CacheList": CacheClass(_read_cache_list, None, holds_kv=False),
    "LayerCache": CacheClass(_read_state, None, holds_kv=False),  # deepseek_v41's own
}
"""Every mlx-lm cache class kvsnap captures, by class name: the one place to add a class."""
