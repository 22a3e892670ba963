"""Recurrent state (an mlx-lm `ArraysCache`) <-> named arrays of a snapshot (SPEC 15.4).

Hybrid and recurrent models (Mamba, Qwen3-Next, LFM2, RWKV-7, Jamba, ...) keep, per layer, a list
of arrays beside or instead of K/V: a convolution window, an SSM or gated-delta-net state, a
token shift. Each entry ("slot") of the list is stored as arrays attached to every snapshot:

- an array of 4 or more axes ``(batch, heads, a, b, ...)`` has a head axis: one array per head,
  named ``state/{layer}/{slot}/{head}``, of ``(batch * a, b * ...)`` elements;
- any other array ``(batch, a, b, ...)`` is one array ``state/{layer}/{slot}`` of
  ``(batch * a, b * ...)`` elements (``(batch, 1)`` for a ``(batch,)`` array).

The layer's attributes say what each slot holds (``state``: shape, dtype, heads, role), so the
arrays are put back into the same `ArraysCache` bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from kvformat import CorruptFileError, dtypes
from kvformat.state import WORDS, array_name, grown_shape, numpy_dtype
from kvformat.state import checked as checked_description

from .conversion import host_dtype, to_mlx, to_numpy
from .errors import CaptureError, UnsupportedModelError

ROLES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("mamba", "mamba2", "nemotron_h", "granitemoehybrid", "jamba", "falcon_h1", "plamo2", "kimi_k3"),
        ("conv", "ssm"),
    ),
    **dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_moe", "prism_hadamard_qwen35"), ("conv", "recurrent")),
    **dict.fromkeys(
        ("kimi_linear", "olmo_hybrid", "bailing_moe_v3"), ("conv_q", "conv_k", "conv_v", "recurrent")
    ),
    **dict.fromkeys(("lfm2", "lfm2_moe", "lfm2-vl", "longcat_flash_ngram"), ("conv",)),
    **dict.fromkeys(("bailing_hybrid", "bailing_moe_linear"), ("recurrent",)),
    "rwkv7": ("token_shift_attention", "state", "token_shift_ffn"),
    "recurrent_gemma": ("conv", "rg_lru"),
    "baichuan_m1": ("last_k", "last_v"),
}
"""What each slot of a model's `ArraysCache` holds, by ``model_type`` (informative: a slot of a
model not listed is named ``slot{i}``)."""


LAYER_CACHE_FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")
"""The arrays of deepseek_v41's own `LayerCache`, stored as its slots, then its ``offset``."""

LAYER_CACHE_APPENDED = ("compress_kv", "index_k")
"""The `LayerCache` arrays that only ever gain rows (closed groups and their index keys: the
model appends to them, and its cache is not trimmable): a series stores each row once (SPEC
15.4, ``append``). Its window is the last ``window_size`` rows of the rows appended to it
(``append`` with ``last``); only the open group's rows are stored whole."""

HOLDERS = ("ArraysCache", "LayerCache")
"""Cache classes whose contents are stored as state (they hold no K/V kvsnap can append to)."""


def of(cache: Any) -> tuple[Any, int | None]:
    """The state holder of one layer's cache (an `ArraysCache` or `LayerCache` itself, or the
    `ArraysCache` inside a `CacheList`) and its position in the list (None outside a list);
    ``(None, None)`` if it has none."""
    if type(cache).__name__ in HOLDERS:
        return cache, None
    if type(cache).__name__ == "CacheList":
        found = [i for i, c in enumerate(cache.caches) if type(c).__name__ == "ArraysCache"]
        if len(found) > 1:
            raise UnsupportedModelError(
                f"a CacheList holding {len(found)} ArraysCache objects is not supported"
            )
        if found:
            return cache.caches[found[0]], found[0]
    return None, None


def slots(holder: Any) -> list[Any]:
    """The arrays a state holder keeps, in slot order (None for a slot not set)."""
    if type(holder).__name__ == "LayerCache":
        offset = mx.array([int(holder.offset)], dtype=mx.int64)
        return [getattr(holder, name) for name in LAYER_CACHE_FIELDS] + [offset]
    return list(holder.cache)


def restore_layer_cache(cls: Any, window_size: int, values: list[Any]) -> Any:
    """A `LayerCache` of class ``cls`` holding ``values`` (`slots` order)."""
    cache = cls(window_size)
    for name, value in zip(LAYER_CACHE_FIELDS, values, strict=False):
        setattr(cache, name, value)
    cache.offset = int(np.array(values[len(LAYER_CACHE_FIELDS)]).reshape(-1)[0])
    return cache


def _heads(shape: tuple[int, ...]) -> int | None:
    return int(shape[1]) if len(shape) >= 4 else None


def describe(holder: Any) -> list[dict[str, Any] | None]:
    """The layer attribute ``state``: per slot ``{"shape", "dtype", "heads", "role"}`` (``shape``
    with the batch axis first; ``heads`` the size of axis 1 for arrays of 4 or more axes, else
    None; ``role`` ``slot{i}`` until `model_info.annotate_layers` names it), or None for a slot
    not yet set. A `LayerCache`'s arrays grow as tokens come (its window until it is full, its
    compressed groups, its open group's rows): their axis 1 is ``null`` (SPEC 15.4), and a slot
    not set yet is ``(S, null, null)`` of ``null`` type: each snapshot's chunk gives its width
    and float type."""
    out: list[dict[str, Any] | None] = []
    roles = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate", "offset")
    named = type(holder).__name__ == "LayerCache"
    batch = _layer_cache_batch(holder) if named else 1
    for slot, value in enumerate(slots(holder)):
        grows = named and slot < len(LAYER_CACHE_FIELDS)
        appended: dict[str, Any] = {}
        if named and roles[slot] in LAYER_CACHE_APPENDED:
            appended = {"append": True}
        elif named and roles[slot] == "window":  # the last window_size rows of all appended
            appended = {"append": True, "last": int(holder.window_size)}
        if value is None:
            out.append(
                {"shape": [batch, None, None], "dtype": None, "heads": None, "role": roles[slot], **appended}
                if grows
                else None
            )
            continue
        if not isinstance(value, mx.array):
            raise UnsupportedModelError(
                f"ArraysCache slot {slot} holds a {type(value).__name__}, not an array; it cannot be stored"
            )
        shape: list[int | None] = [int(n) for n in value.shape]
        if not shape:
            raise UnsupportedModelError(f"ArraysCache slot {slot} holds a scalar, not a per-sequence array")
        if grows:
            if len(shape) != 3:
                raise UnsupportedModelError(
                    f"LayerCache {LAYER_CACHE_FIELDS[slot]} of shape {shape}: expected (batch, rows, width)"
                )
            shape[1] = None
        out.append(
            {
                "shape": shape,
                "dtype": _dtype_name(value.dtype),
                "heads": _heads(tuple(n or 0 for n in shape)),
                "role": roles[slot] if named else f"slot{slot}",
                **appended,
            }
        )
    return out


def _layer_cache_batch(holder: Any) -> int:
    """The sequences a `LayerCache` holds (1 before its first call)."""
    for name in LAYER_CACHE_FIELDS:
        value = getattr(holder, name, None)
        if isinstance(value, mx.array) and value.ndim:
            return int(value.shape[0])
    return 1


def _fits(described: list[Any], shape: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` is one a slot described as ``described`` holds (``null``: any
    length)."""
    pairs = zip(described, shape, strict=False)
    return len(described) == len(shape) and all(d is None or d == n for d, n in pairs)


def _dtype_name(dtype: Any) -> str:
    found = host_dtype(dtype)
    if found.name in WORDS:
        return found.name
    try:
        return dtypes.from_numpy(found).name
    except Exception:
        raise UnsupportedModelError(f"recurrent state of type {found} cannot be stored") from None


def _as_words(array: Any, name: str) -> Any:
    """An integer slot's elements as float32 words (a float slot as it is)."""
    return array.view(mx.float32) if name in WORDS else array


def local_name(slot: int, head: int | None = None) -> str:
    """One slot's (and head's) array within its layer: ``"{slot}"`` or ``"{slot}/{head}"``."""
    return f"{slot}" if head is None else f"{slot}/{head}"


def name(layer: int, local: str) -> str:
    """The snapshot array name of a layer's state array ``local`` (SPEC 15.4)."""
    slot, _, head = local.partition("/")
    return array_name(layer, int(slot), int(head) if head else None)


def _two_d(array: Any, shape: tuple[int, ...]) -> Any:
    """Elements of shape ``(batch, a, b, ...)`` as ``(batch * a, b * ...)``, ``(batch, a)`` as
    is, ``(batch,)`` as ``(batch, 1)`` (``shape`` the slot's; ``array`` its integers viewed as
    float32 words: wider rows); an array of no elements keeps its width."""
    rows = shape[0] if len(shape) <= 2 else shape[0] * shape[1]
    if rows:
        return array.reshape(rows, -1)
    return array.reshape(0, math.prod(array.shape[min(len(shape), 2) :]))


def device_arrays(
    layer: int, holder: Any, described: list[dict[str, Any] | None], stored: dict[int, int] | None = None
) -> dict[str, mx.array]:
    """The arrays of one layer's state, as lazy mlx arrays ``(rows, width)`` by local name
    (`local_name`; `describe` gave ``described`` when the file was opened; ``layer`` names the
    layer in errors). ``stored``: for a series, per appended slot (``append``) the rows along
    axis 1 appended by the time of the previous snapshot; only the rows after them are returned
    (none added: no array; a window that moved on further than it holds: all it holds), and
    ``stored`` is updated."""
    out: dict[str, mx.array] = {}
    for slot, value in enumerate(slots(holder)):
        entry = described[slot] if slot < len(described) else None
        if value is None:
            continue
        if stored is not None and entry is not None and entry.get("append"):
            # Rows appended so far: a window's are the tokens its layer processed (it keeps the
            # last ones), another slot's all its rows.
            total = int(holder.offset) if entry.get("last") else int(value.shape[1])
            held = stored.get(slot, 0)
            if total < held:
                raise CaptureError(
                    f"layer {layer}: state slot {slot} ({entry.get('role')}) lost rows during generation "
                    f"({total} after {held}); it cannot be stored as rows appended"
                )
            stored[slot] = total
            if total == held:
                continue
            value = value[:, -min(total - held, int(value.shape[1])) :]
        shape = tuple(int(n) for n in value.shape)
        if entry is None or not _fits(entry["shape"], shape):
            raise CaptureError(
                f"layer {layer}: state slot {slot} changed shape to {list(shape)} during generation "
                f"(the file describes {entry and entry['shape']})"
            )
        words = _as_words(value, entry["dtype"])
        if entry["heads"] is None:
            out[local_name(slot)] = _two_d(words, shape)
        else:
            for head in range(entry["heads"]):
                out[local_name(slot, head)] = _two_d(words[:, head], (shape[0], *shape[2:]))
    return out


def host_arrays(layer: int, holder: Any, described: list[dict[str, Any] | None]) -> dict[str, np.ndarray]:
    """`device_arrays` copied to the host (numpy)."""
    arrays = device_arrays(layer, holder, described)
    mx.eval(list(arrays.values()))
    return {key: np.ascontiguousarray(to_numpy(value)) for key, value in arrays.items()}


def values(described: list[dict[str, Any] | None], read: Any) -> list[Any]:
    """Each slot's array (mlx, or None for a slot not set) from the arrays ``read(local_name)``
    returns (``(rows, width)`` numpy or None) for one layer whose ``state`` is ``described``."""
    out: list[Any] = []
    for slot, entry in enumerate(described):
        if entry is None:
            out.append(None)
            continue
        if None in entry["shape"]:  # it grows (a `LayerCache`): the stored rows give its length
            out.append(_grown(read, local_name(slot), entry))
            continue
        shape = tuple(int(n) for n in entry["shape"])
        dtype = numpy_dtype(entry["dtype"])
        if entry["heads"] is None:
            value = _stored(read, local_name(slot), shape, dtype).reshape(shape)
        else:
            per_head = (shape[0], *shape[2:])
            heads = [
                _stored(read, local_name(slot, h), per_head, dtype).reshape(per_head) for h in range(shape[1])
            ]
            value = np.stack(heads, axis=1)
        out.append(to_mlx(np.ascontiguousarray(value)))
    return out


def rebuild(described: list[dict[str, Any] | None], read: Any) -> Any:
    """A live `ArraysCache` holding the stored `values`."""
    from mlx_lm.models.cache import ArraysCache

    cache = ArraysCache(size=len(described))
    for slot, value in enumerate(values(described, read)):
        cache[slot] = value
    return cache


def _grown(read: Any, key: str, entry: dict[str, Any]) -> Any:
    """A growing slot's array (``(S, null, b)`` or ``(S, null, null)``), shaped from its stored
    ``(S * a, b)`` rows; None where the snapshot holds none (the slot was not set at that
    moment, SPEC 15.4)."""
    array = read(key)
    if array is None:
        return None
    array = np.asarray(array)
    shape = grown_shape(tuple(entry["shape"]), array.shape)
    dtype = None if entry["dtype"] is None else numpy_dtype(entry["dtype"])
    if shape is None or (dtype is not None and array.dtype != dtype):
        raise UnsupportedModelError(
            f"state array {key!r} holds {array.shape} {array.dtype}, "
            f"the layer describes {entry['shape']} {entry['dtype']}"
        )
    return to_mlx(np.ascontiguousarray(array.reshape(shape)))


def _stored(read: Any, key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    array = read(key)
    if array is None:
        raise UnsupportedModelError(
            f"the snapshot lacks recurrent state array {key!r} of this layer; it cannot be restored"
        )
    array = np.asarray(array)
    if dtype.name in WORDS and array.dtype == np.float32 and array.flags.c_contiguous:
        array = array.view(dtype)
    if array.size != math.prod(shape) or array.dtype != dtype:
        raise UnsupportedModelError(
            f"state array {key!r} holds {array.shape} {array.dtype}, "
            f"the layer describes {list(shape)} {dtype}"
        )
    return array


def checked(layer: int, described: Any) -> list[dict[str, Any] | None]:
    """A ``state`` attribute read from a file, checked (`kvformat.state.checked`): anything but a
    state description is `UnsupportedModelError` naming the layer, never a deep traceback."""
    try:
        return checked_description(layer, described)
    except CorruptFileError as exc:
        raise UnsupportedModelError(str(exc)) from None


def local_names(described: list[dict[str, Any] | None]) -> list[str]:
    """Every array name (`local_name`) a layer's state described as ``described`` stores."""
    names: list[str] = []
    for slot, entry in enumerate(described):
        if entry is None:
            continue
        heads = entry["heads"]
        names += [local_name(slot)] if heads is None else [local_name(slot, h) for h in range(heads)]
    return names
