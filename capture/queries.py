"""Capturing queries (format 1.3): the post-RoPE queries each layer hands to attention.

mlx-lm's attention modules call ``scaled_dot_product_attention`` (``mlx_lm.models.base``) as each
model module imports it, with the queries after RoPE, the cache, the scale and (gpt-oss) the sink
logits. `QueryRecorder` puts a wrapper in its place in every loaded ``mlx_lm.models`` module for
the length of one generation: it returns exactly what the original returns (generation is
unchanged) and keeps, per layer, a device slice of the queries at the selected positions (no host
copy, no synchronisation); `take` hands what accumulated since the previous snapshot to the
snapshot's background transfer, like the K/V deltas.

Some attention modules compute attention themselves (Gemma 2 soft-caps its logits, PLaMo 2 calls
``mx.fast.scaled_dot_product_attention`` directly). Each such class is one entry of `OWN_ATTENTION`:
while recording, its ``__call__`` is wrapped to see the queries its ``rope`` returns, with the scale
and soft-cap the module holds (the architecture check holds the recomputed attention to what
reaches its output projection).

Sparse attention (DeepSeek-V3.2, GLM-5): each attention module's ``indexer`` picks the keys each
query reads (its top-k once the cache holds more). While recording, the indexer is wrapped
(`_IndexerTap`) and what it returns is kept beside the queries of the call that follows, as the
layer's key selections (format 1.7); a decode call's gathered keys are checked against the score
the model added, as for dense latent attention.

Selections (``--queries``): ``none``; ``decode`` (every generated position); ``window:W`` (the last
``W`` prompt positions, SnapKV's observation window, and every generated one); ``all``.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

import kvformat
from kvformat import Pooled, QuerySpec
from kvformat.errors import InvalidArgumentError, UnknownNameError

from .errors import CaptureError, UnsupportedModelError
from .gather import join

MODES = ("none", "decode", "window", "all")


@dataclass(frozen=True)
class QuerySelection:
    """Which query positions a capture keeps: ``mode`` one of `MODES`, ``window`` for
    ``window:W``."""

    mode: str = "none"
    window: int = 0

    @classmethod
    def parse(cls, text: str | QuerySelection | None) -> QuerySelection:
        """``none``, ``decode``, ``window:W`` (W >= 1) or ``all``; ValueError naming the choices."""
        if isinstance(text, QuerySelection):
            return text
        if text is None:
            return cls()
        name, _, value = str(text).partition(":")
        if name == "window":
            try:
                size = int(value)
            except ValueError:
                size = 0
            if size < 1:
                raise InvalidArgumentError(
                    f"--queries {text!r}: window:W needs a positive number of prompt positions W"
                )
            return cls("window", size)
        if name not in MODES or value:
            raise UnknownNameError(f"--queries {text!r}: choose none, decode, window:W or all")
        return cls(name)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def first_position(self, prompt_tokens: int) -> int:
        """The first absolute position kept, for a prompt of ``prompt_tokens`` tokens."""
        if self.mode == "all":
            return 0
        if self.mode == "window":
            return max(0, prompt_tokens - self.window)
        return prompt_tokens  # decode: the positions of generated tokens

    def to_json(self) -> str:
        return f"window:{self.window}" if self.mode == "window" else self.mode


@dataclass(frozen=True)
class OwnAttention:
    """An attention module class that computes attention itself, and where its settings are:
    ``scale`` and ``softcap`` name the module's attributes (``softcap`` None: no soft-capping).
    Its ``rope`` is called on the queries first, then the keys, with the cache's offset; its
    output projection ``o_proj`` receives the attention output ``(batch, L, heads * dim)``."""

    scale: str = "scale"
    softcap: str | None = None


OWN_ATTENTION: dict[str, OwnAttention] = {
    "mlx_lm.models.gemma2.Attention": OwnAttention(softcap="attn_logit_softcapping"),
    "mlx_lm.models.plamo2.Attention": OwnAttention(),
}
"""Attention classes (``module.QualName``) recorded by their own call: one entry a class."""


def own_attention(module: Any) -> OwnAttention | None:
    """``module``'s `OWN_ATTENTION` entry, or None."""
    kind = type(module)
    return OWN_ATTENTION.get(f"{kind.__module__}.{kind.__qualname__}")


def _weak(keys: Any) -> Any:
    """What identifies ``keys`` (an array, or a quantized cache's tuple of three) without keeping
    it alive: a weak reference to each array, so that an array freed since, whose ``id`` a new
    one took, is never taken for it (a strong reference where an object takes no weak one)."""
    if isinstance(keys, tuple):
        return tuple(_weak(part) for part in keys)
    try:
        return weakref.ref(keys)
    except TypeError:
        return lambda: keys


def _is(seen: Any, keys: Any) -> bool:
    """Whether ``keys`` is the very object (every array of it) `_weak` saw."""
    if isinstance(seen, tuple):
        return (
            isinstance(keys, tuple)
            and len(keys) == len(seen)
            and all(_is(ref, part) for ref, part in zip(seen, keys, strict=True))
        )
    return seen() is keys


@dataclass
class _Layer:
    """What one layer's attention was seen doing: its scale and sinks, the query shape, and the
    query slices kept since the last snapshot."""

    scale: float
    sinks: Any
    num_heads: int
    dim: int
    dtype: Any
    pending: list[tuple[mx.array, int]]
    end: int = 0  # one past the last position seen
    latent: bool = False  # absorbed multi-head latent attention: queries [q_c; q_r]
    softcap: float | None = None  # logit soft-capping of an attention module of its own
    groups: int = 1  # attention calls on this layer's K/V per step (another layer sharing it)
    step: tuple[int, int] = (-1, 0)  # the current step's (start, calls so far)
    extra: list[list[tuple[mx.array, int]]] = field(default_factory=list)  # groups 1.. pending


def check_hookable(model: Any) -> None:
    """Refuse, before anything is generated, a model none of whose modules computes attention
    through mlx-lm's ``scaled_dot_product_attention``, where `QueryRecorder` records the queries,
    or is an `OWN_ATTENTION` class (state-space models, olmo): its file would hold no queries."""
    from mlx_lm.models import base

    args = getattr(model, "args", None)
    architecture = getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]
    hooked = base.scaled_dot_product_attention
    modules = model.modules()
    names = {type(module).__module__ for module in modules}
    if any(getattr(sys.modules.get(name), "scaled_dot_product_attention", None) is hooked for name in names):
        return
    if any(own_attention(module) is not None for module in modules):
        return
    from .caches import compressed_attention

    if compressed_attention(model):  # DeepSeek-V4.1: its attention call is recorded itself
        return
    raise UnsupportedModelError(
        f"queries: {architecture} computes attention without mlx-lm's scaled_dot_product_attention, "
        'where kvsnap records queries; capture it without --queries (queries="none")'
    )


def hook_attention(wrapper: Callable[..., Any]) -> list[tuple[Any, Any]]:
    """Put ``wrapper`` in place of mlx-lm's ``scaled_dot_product_attention`` in every loaded model
    module that calls it; returns what `unhook_attention` puts back."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention
    saved = []
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mlx_lm.models.")
            and getattr(module, "scaled_dot_product_attention", None) is original
        ):
            saved.append((module, original))
            setattr(module, "scaled_dot_product_attention", wrapper)  # noqa: B010 - any module
    return saved


def unhook_attention(saved: list[tuple[Any, Any]]) -> None:
    """Undo `hook_attention` (``saved`` is emptied)."""
    for module, original in saved:
        setattr(module, "scaled_dot_product_attention", original)  # noqa: B010
    saved.clear()


class QueryRecorder:
    """Keeps the selected queries of every layer of ``prompt_cache`` while installed (a context
    manager); ``first`` is the first absolute position kept."""

    def __init__(self, prompt_cache: list[Any], first: int, model: Any = None) -> None:
        self._caches = prompt_cache  # mlx-lm may replace entries (--kv-bits quantizes in place)
        self._layer_of = self._places()
        self._first = first
        self._kv_map: dict[int, tuple[int, ...] | None] = {}
        self.layers: dict[int, _Layer] = {}
        self._saved: list[tuple[Any, Callable[..., Any]]] = []
        self._latent_modules = _latent_modules(model)
        self._rope_out: list[tuple[Any, mx.array]] = []  # what an MLA module's RoPE just returned
        self._latent_checks: list[tuple[int, mx.array]] = []
        self._taken = False  # whether a snapshot took the queries (the layout is then fixed)
        # Per layer, the keys its last attention call read: a layer sharing them (Gemma-4, afm7)
        # passes the same array without a cache. Held weakly (`_weak`): a reference kept until the
        # layer's next step would stop mlx from updating its cache buffer in place, so every
        # step would copy the whole buffer. Only the very last call's keys are held (`_copy_of`).
        self._last_keys: dict[int, tuple[tuple[int, Any], int, Any]] = {}  # (place, id, `_weak`)
        self._read_by: dict[int, int] = {}  # id(keys) -> the layer whose last call read them
        self._last_place: tuple[int, Any] | None = None
        self._last_read: Any = None  # the keys of the last attention call
        self._copy_checks: list[tuple[int, mx.array]] = []  # afm7: keys read as a copy
        self._copies_checked: set[int] = set()
        modules = model.modules() if model is not None else []
        self._own_classes = {type(m) for m in modules if own_attention(m) is not None}
        self._own_saved: list[tuple[type, Any]] = []
        # MLA classes whose call scales the whole query per position after RoPE (Mistral-4's
        # Llama-4 ``attn_scale``), and the scale of each module's call in progress.
        latent_classes = {type(m) for m in self._latent_modules}
        self._scaled_classes = {
            c for c in latent_classes if "attn_scale" in inspect.signature(c.__call__).parameters
        }
        self._query_scale: dict[int, Any] = {}
        # Sparse attention (DeepSeek-V3.2's indexer): what the indexer just chose, for the
        # attention call that follows it in the same module call.
        self._indexers = _indexers(model)
        self._chosen: tuple[int, Any] | None = None
        self._widths: dict[int, int] = {}  # layer -> its indexer's top-k
        self._selected: dict[int, list[tuple[mx.array, int]]] = {}  # layer -> pending selections
        self._compressed = _CompressedAttention(self, prompt_cache, model)

    def __enter__(self) -> QueryRecorder:
        from mlx_lm.models import base

        for module in self._latent_modules:  # see each MLA module's RoPE'd query part
            if hasattr(module, "rope"):
                module.rope = _RopeTap(self, module, module.rope)
            else:  # no RoPE (Kimi-Linear): the query projection's last channels per head
                name = _query_projection(module)
                setattr(module, name, _QueryPartTap(self, module, getattr(module, name)))
        for module in self._indexers:
            module.indexer = _IndexerTap(self, module.indexer)
        self._saved = hook_attention(self._wrap(base.scaled_dot_product_attention))
        self._compressed.install()
        for kind in self._own_classes:
            self._own_saved.append((kind, kind.__call__))
            kind.__call__ = self._wrap_own(kind.__call__)
        for kind in self._scaled_classes:
            self._own_saved.append((kind, kind.__call__))
            kind.__call__ = self._wrap_scaled(kind.__call__)
        return self

    def _wrap_scaled(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` (an MLA class's ``__call__`` taking ``attn_scale``) that keeps the call's
        query scale while it runs, for `_latent_queries` to scale the RoPE'd query part as the
        model does."""
        signature = inspect.signature(call)

        @functools.wraps(call)
        def attention(module: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(module, *args, **kwargs)
            self._query_scale[id(module)] = bound.arguments["attn_scale"]
            try:
                return call(module, *args, **kwargs)
            finally:
                self._query_scale.pop(id(module), None)

        return attention

    def __exit__(self, *exc: object) -> None:
        unhook_attention(self._saved)
        self._compressed.remove()
        for kind, call in reversed(self._own_saved):
            kind.__call__ = call
        self._own_saved.clear()
        for module in self._indexers:
            if isinstance(module.indexer, _IndexerTap):
                module.indexer = module.indexer.indexer
        for module in self._latent_modules:
            if isinstance(getattr(module, "rope", None), _RopeTap):
                module.rope = module.rope.rope
            elif not hasattr(module, "rope"):
                name = _query_projection(module)
                if isinstance(getattr(module, name), _QueryPartTap):
                    setattr(module, name, getattr(module, name).projection)

    def _wrap_own(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` (an `OWN_ATTENTION` class's ``__call__``) that also keeps the queries its
        module's ``rope`` returned first, with the module's scale and soft-cap."""

        signature = inspect.signature(call)

        @functools.wraps(call)
        def attention(module: Any, *args: Any, **kwargs: Any) -> Any:
            entry = own_attention(module)
            if entry is None:  # a subclass of its own: not what the entry describes
                return call(module, *args, **kwargs)
            bound = signature.bind(module, *args, **kwargs)
            bound.apply_defaults()
            mask, cache = bound.arguments.get("mask"), bound.arguments.get("cache")
            outputs: list[mx.array] = []
            rope = module.rope
            module.rope = CallTap(rope, outputs)
            try:
                out = call(module, *args, **kwargs)
            finally:
                module.rope = rope
            place = self._place(cache, None)
            if isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating):
                raise CaptureError(
                    f"queries: layer {place[0]}'s attention adds a score term of its own (a float "
                    "mask), which its queries do not carry; capture without --queries"
                )
            softcap = float(getattr(module, entry.softcap)) if entry.softcap else None
            self._keep(place[0], outputs[0], place[1], float(getattr(module, entry.scale)), None, None)
            self.layers[place[0]].softcap = softcap
            return out

        return attention

    def _copy_of(self, keys: Any) -> tuple[int, Any] | None:
        """For an attention call without a cache whose keys are not another call's array: the
        layer that ran attention last, where its keys have their shape (afm7's shared layers read
        a copy of the last layer's K/V); that they are equal is checked once per layer, at the
        next snapshot (`take`), before a file holds anything."""
        place = self._last_place
        if place is None or not isinstance(keys, mx.array):
            return None
        source = self._last_read
        if not isinstance(source, mx.array) or source.shape != keys.shape:
            return None
        if place[0] not in self._copies_checked:
            self._copies_checked.add(place[0])
            self._copy_checks.append((place[0], mx.array_equal(keys, source)))
        return place

    def _latent_queries(
        self,
        layer: int,
        queries: mx.array,
        keys: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        chosen: Any = None,
    ) -> mx.array | None:
        """The absorbed query ``[q_c; q_r]`` of an MLA layer's call (SPEC 10.1, ``latent``), or
        None where no MLA module's RoPE ran just before (an ordinary attention call): ``q_c`` is
        what attention received in absorbed form (decode; the prefill's per-head queries go
        through the module's ``embed_q``), ``q_r`` the RoPE'd part the module computed. Whether
        ``scale * q_r . r_j`` is the score the model added as its mask is checked at the next
        snapshot (`take`). ``chosen``: the indexer's top-k ``(batch, 1, L, k)`` of a sparse layer's
        call, or None; a decode call then reads those keys only, gathered."""
        if not self._rope_out:  # no MLA module's RoPE ran: an ordinary call
            return None
        found = [(m, out) for m, out in self._rope_out if out.shape[1] == queries.shape[1]]
        self._rope_out = []
        if not found:
            return None
        scored = isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating)
        module, rope_part = found[0]
        if id(module) in self._query_scale:  # the query scaled after RoPE, as the model scales it
            rope_part = rope_part * self._query_scale[id(module)]
        if not scored:  # its mask a mask: an ordinary call, or an MLA prompt's unabsorbed one
            return self._unabsorbed(layer, module, queries, keys, cache)
        absorbed = queries if keys.shape[1] == 1 else module.embed_q(queries)
        if isinstance(getattr(cache, "values", None), mx.array):
            end = int(cache.offset)
            rope_keys = _read_keys(layer, cache.values[:, :, :end, :], mask.shape[-1], chosen)
            score = (rope_part * scale) @ rope_keys.swapaxes(-1, -2)
            counted = mask > mx.finfo(mask.dtype).min / 2
            largest = mx.maximum(mx.max(mx.where(counted, mx.abs(mask), 0)), 1e-30)
            self._latent_checks.append((layer, mx.max(mx.where(counted, mx.abs(score - mask), 0)) / largest))
        return mx.concatenate([absorbed, rope_part.astype(absorbed.dtype)], axis=-1)

    def _unabsorbed(
        self, layer: int, module: Any, queries: mx.array, keys: Any, cache: Any
    ) -> mx.array | None:
        """The absorbed query ``[q_c; q_r]`` of an MLA prompt's call in unabsorbed form (Mistral-4:
        per head ``[q_nope; q_r]`` over ``[embed_q(latent); RoPE key]``), or None where the call
        is not in that form. That the keys are the cached latents and RoPE keys is checked at the
        next snapshot (`take`)."""
        nope = getattr(module, "qk_nope_head_dim", None)
        held, rope_keys = getattr(cache, "keys", None), getattr(cache, "values", None)
        if (
            not isinstance(nope, int)
            or not isinstance(keys, mx.array)
            or not isinstance(held, mx.array)
            or not isinstance(rope_keys, mx.array)
            or keys.shape[1] != queries.shape[1]
            or queries.shape[-1] != nope + rope_keys.shape[-1]
        ):
            return None
        end = int(cache.offset)
        latent_keys = module.embed_q(held[:, :, :end, :], transpose=False)
        shape = (*latent_keys.shape[:3], rope_keys.shape[-1])
        position_keys = mx.broadcast_to(rope_keys[:, :, :end, :], shape)
        expected = mx.concatenate([latent_keys, position_keys.astype(latent_keys.dtype)], axis=-1)
        largest = mx.maximum(mx.max(mx.abs(expected)), 1e-30)
        self._latent_checks.append((layer, mx.max(mx.abs(keys - expected)) / largest))
        absorbed = module.embed_q(queries[..., :nope])
        return mx.concatenate([absorbed, queries[..., nope:].astype(absorbed.dtype)], axis=-1)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def scaled_dot_product_attention(
            queries: mx.array,
            keys: mx.array,
            values: mx.array,
            cache: Any,
            scale: float,
            mask: Any,
            sinks: Any = None,
        ) -> mx.array:
            place = self._layer_of.get(id(cache))
            if (
                place is not None
                and self._chosen is None
                and not self._rope_out
                and not isinstance(mask, mx.array)
                and not self._shared_by_another(place[0], keys)
            ):  # an ordinary call on its layer's own cache and keys (every decode call, mostly)
                self._remember_keys(place, keys)
                self._keep(place[0], queries, place[1], scale, sinks, keys)
                return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
            place = self._place(cache, keys)
            chosen, self._chosen = self._chosen, None
            latent = self._latent_queries(
                place[0], queries, keys, place[1], scale, mask, chosen[1] if chosen else None
            )
            if chosen is not None:
                self._select(place[0], place[1], queries.shape[2], chosen)
            if latent is not None:
                self._keep(place[0], latent, place[1], scale, sinks, None, latent=True)
            else:
                if isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating):
                    raise CaptureError(
                        f"queries: layer {place[0]}'s attention adds a score term of its own (a float "
                        "mask), which its queries do not carry; capture without --queries"
                    )
                self._keep(place[0], queries, place[1], scale, sinks, keys)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

        return scaled_dot_product_attention

    def _place(self, cache: Any, keys: Any) -> tuple[int, Any]:
        """``(file layer, its K/V cache)`` of an attention call on ``cache`` reading ``keys``;
        `CaptureError` where no layer's cache is its own."""
        place = self._cache_place(cache)
        # The very keys another layer's call read: that layer's K/V, read again (Gemma-3n's shared
        # layers pass no cache; iQuest's second loop passes its own cache with the first loop's keys).
        shared = self._shared_place(keys)
        if shared is not None and (place is None or shared[0] != place[0]):
            return shared
        if place is None and cache is None and keys is not None:
            place = self._copy_of(keys)
        elif place is not None:
            self._remember_keys(place, keys)
        if place is None:
            raise CaptureError(
                "queries: one of this model's attention calls reads K/V of no layer's cache of "
                "its own (a layer that shares another layer's K/V); its queries would have no "
                "layer in the file: capture without --queries"
            )
        return place

    def _cache_place(self, cache: Any) -> tuple[int, Any] | None:
        """`_places`' entry of ``cache`` (mapped again where mlx-lm replaced a cache since)."""
        place = self._layer_of.get(id(cache))
        if place is None and cache is not None:
            self._layer_of = self._places()
            place = self._layer_of.get(id(cache))
        return place

    def _remember_keys(self, place: tuple[int, Any], keys: Any) -> None:
        """The keys the layer at ``place`` just read, found again by identity in O(1)."""
        layer = place[0]
        before = self._last_keys.get(layer)
        if before is not None and self._read_by.get(before[1]) == layer:
            del self._read_by[before[1]]  # (its id may be another layer's keys' by now)
        ident = id(keys)
        self._last_keys[layer] = (place, ident, _weak(keys))
        self._read_by[ident] = layer
        self._last_place = place
        self._last_read = keys

    def _shared_by_another(self, layer: int, keys: Any) -> bool:
        """Whether ``keys`` are the very keys another layer's last call read (`_place`'s test,
        for a call on ``layer``'s own cache)."""
        shared = self._shared_place(keys)
        return shared is not None and shared[0] != layer

    def _shared_place(self, keys: Any) -> tuple[int, Any] | None:
        """The place of the layer whose last attention call read the very array ``keys`` (one
        dictionary lookup a call: every attention call of a step asks)."""
        layer = None if keys is None else self._read_by.get(id(keys))
        if layer is None:
            return None
        place, _, read = self._last_keys[layer]
        return place if _is(read, keys) else None

    def _places(self) -> dict[int, tuple[int, Any]]:
        """``id(cache object) -> (file layer, the K/V cache whose offset counts its positions)``
        for every cache the model may hand to attention: each layer's cache, a `CacheList`
        and its K/V caches (the first is its layer's; each further one has a file layer of its
        own, `caches.file_caches`)."""
        from .caches import file_caches, kv_sub_caches

        places: dict[int, tuple[int, Any]] = {}
        for index, (cache, _) in enumerate(file_caches(self._caches)):
            places.setdefault(id(cache), (index, cache))
            if type(cache).__name__ == "CacheList":
                kv = kv_sub_caches(cache)
                if kv:
                    places[id(cache)] = (index, cache.caches[kv[0]])
                    places.setdefault(id(cache.caches[kv[0]]), (index, cache.caches[kv[0]]))
        return places

    def _keep(
        self,
        layer: int,
        queries: mx.array,
        cache: Any,
        scale: float,
        sinks: Any,
        keys: Any,
        latent: bool = False,
    ) -> None:
        end = _end_of(layer, cache)
        _, heads, length, dim = queries.shape
        start = end - length
        seen = self.layers.get(layer)
        if seen is None:
            seen = _Layer(float(scale), sinks, heads, dim, queries.dtype, [], latent=latent)
            self.layers[layer] = seen
            self._kv_map[layer] = None if latent else _kv_heads_of(layer, queries, keys, cache)
        elif seen.dim != dim or seen.num_heads != heads or seen.scale != float(scale):
            raise CaptureError(
                f"queries: layer {layer}'s attention ran with other query shapes or another scale "
                "(another layer reads its K/V differently); capture without --queries"
            )
        group = self._reader(layer, seen, start, end)
        seen.end = end
        first = max(start, self._first)
        if first < end:
            # Decode steps keep the (batch, heads, 1, dim) array itself, no op, except where the
            # attention function updates it in place (mlx-lm's quantized one: ``queries *= scale``):
            # a slice is a node of its own, which the in-place update leaves as it was.
            whole = first == start and not hasattr(cache, "bits")
            piece = (queries if whole else queries[:, :, first - start :, :], first)
            (seen.pending if group == 0 else seen.extra[group - 1]).append(piece)

    def _select(self, layer: int, cache: Any, length: int, chosen: tuple[int, Any]) -> None:
        """Keep a sparse layer's key selection of a call on ``length`` positions: ``chosen`` is
        the indexer's top-k and, for its call, the ``(batch, 1, length, k)`` key positions it
        chose, or None (it chose none: the cache held no more keys than its top-k)."""
        width, indices = chosen
        self._widths[layer] = width
        if indices is None:
            return
        end = _end_of(layer, cache)
        start = end - length
        first = max(start, self._first)
        if first < end:
            piece = indices if first == start else indices[:, :, first - start :, :]
            self._selected.setdefault(layer, []).append((piece, first))

    def _reader(self, layer: int, seen: _Layer, start: int, end: int) -> int:
        """Which reader of the layer's K/V a call on positions ``start .. end`` is: 0, or the next
        one of the same step (a layer sharing this one's K/V)."""
        if start >= seen.end:
            seen.step = (start, 1)
            return 0
        step_start, calls = seen.step
        if start != step_start or end != seen.end or seen.latent:
            raise CaptureError(
                f"queries: layer {layer}'s attention ran again for positions it already had, "
                "but not as a second reader of the same step (the model loops over its "
                "layers); its queries cannot be told apart: capture without --queries"
            )
        seen.step = (start, calls + 1)
        if calls >= seen.groups:
            if self._taken:  # a layer starting to share after the file's layout was fixed
                raise CaptureError(f"queries: layer {layer} gained a reader mid-generation")
            seen.groups = calls + 1
            seen.extra.append([])
        return calls

    def take(self) -> tuple[list[mx.array], list[tuple[int, int, int, np.ndarray, bool]]]:
        """What every layer kept since the last call, as few device arrays as possible (not
        evaluated): the layers' pieces of one shape joined along the position axis (`gather.join`:
        on CUDA 64 decode pieces a launch), so the snapshot's transfer carries one array for
        them. Returns those arrays, ``(batch, heads, n, dim)`` each (a sparse layer's key
        selections: ``(batch, 1, n, k)`` integers), and per layer ``(layer, array index, first
        column, positions, whether they are selections)``. What this costs the generating thread
        on CUDA is in the benchmarks in `benchmarks/`."""
        self._verify()
        groups: dict[tuple[Any, ...], list[mx.array]] = {}
        widths: dict[tuple[Any, ...], int] = {}
        placed: list[tuple[int, tuple[Any, ...], int, np.ndarray, bool]] = []
        self._taken = True
        pending = [(layer, seen.pending, False) for layer, seen in sorted(self.layers.items())]
        pending += [(layer, pieces, True) for layer, pieces in sorted(self._selected.items())]
        for layer, pieces, selected in pending:
            if not pieces:
                continue
            arrays = [a for a, _ in pieces] if selected else _readers_side_by_side(layer, self.layers[layer])
            positions = _positions(pieces)
            count = positions.size
            pieces.clear()
            shape = arrays[0].shape
            key = (shape[0], shape[1], shape[3], arrays[0].dtype)
            groups.setdefault(key, []).extend(arrays)
            placed.append((layer, key, widths.get(key, 0), positions, selected))
            widths[key] = widths.get(key, 0) + count
        index = {key: i for i, key in enumerate(groups)}
        joined = [join(parts) for parts in groups.values()]
        return joined, [
            (layer, index[key], column, at, selected) for layer, key, column, at, selected in placed
        ]

    def _verify(self) -> None:
        """The checks a step left to the snapshot (no synchronisation in the step): an MLA
        layer's RoPE score reproduced by its recorded query part, a shared layer's copy of the
        K/V equal to the layer's. `CaptureError` for the first that fails."""
        if self._latent_checks:
            checks, self._latent_checks = self._latent_checks, []
            mx.eval([error for _, error in checks])
            for layer, error in checks:
                difference = float(np.array(error.astype(mx.float32)))
                if difference > 1e-5:
                    raise CaptureError(
                        f"queries: layer {layer}'s latent attention is not what its recorded query "
                        f"and the cached latents and RoPE keys give (relative difference {difference:.1e}: "
                        "the model scales or changes them after its RoPE); capture without --queries"
                    )
        if self._copy_checks:
            copies, self._copy_checks = self._copy_checks, []
            mx.eval([same for _, same in copies])
            for layer, same in copies:
                if not bool(np.array(same)):
                    raise CaptureError(
                        f"queries: an attention call without a cache of its own read keys that are "
                        f"not layer {layer}'s, the layer before it; its queries would have no layer in "
                        "the file: capture without --queries"
                    )

    @staticmethod
    def on_host(
        arrays: list[np.ndarray], layout: list[tuple[int, int, int, np.ndarray, bool]]
    ) -> list[tuple[int, np.ndarray, np.ndarray, bool]]:
        """`take`'s arrays, copied to the host, split back into ``(layer, queries (batch, heads,
        n, dim) or selections (batch, 1, n, k), positions, whether they are selections)``."""
        return [
            (layer, arrays[which][:, :, column : column + positions.size], positions, selected)
            for layer, which, column, positions, selected in layout
        ]

    def readers(self, layer: int) -> int:
        """How many attention calls read the layer's K/V each step: 1, or more where other
        layers share it (Gemma-3n); the file's query heads hold each reader's heads in turn."""
        seen = self.layers.get(layer)
        return seen.groups if seen is not None else 1

    def spec(self, layer: int, kv_heads: int, attributes: dict[str, Any]) -> QuerySpec | None:
        """The layer's `QuerySpec` from what its attention was seen doing and its attributes
        (a sliding window, a kept prefix); None if its attention never ran through the hook."""
        seen = self.layers.get(layer)
        if seen is None:
            return None
        group = max(1, seen.num_heads // max(kv_heads, 1))
        mapped = self._kv_map.get(layer)
        own = mapped if mapped is not None else tuple(h // group for h in range(seen.num_heads))
        return QuerySpec(
            num_heads=seen.num_heads * seen.groups,
            dim=seen.dim,
            dtype=kvformat.dtypes.from_name(str(seen.dtype).removeprefix("mlx.core.")),
            scale=seen.scale,
            kv_heads=own * seen.groups,
            softcap=seen.softcap,
            sinks=_sinks(seen.sinks),
            latent=seen.latent,
            selection=self._widths.get(layer),
            pooled=self._compressed.pooled.get(layer),
            **_visibility(attributes),
        )


@dataclass
class _Offset:
    """What `QueryRecorder._keep` reads of a cache: one past the last position."""

    offset: int


class _CompressedAttention:
    """DeepSeek-V4.1's attention (``mlx_lm.models.deepseek_v41``), recorded while installed: its
    ``Attention`` class's call is wrapped to know the module and its `LayerCache`, and the
    module's ``_sparse_attention`` replaced by a function that returns exactly what it returns
    and keeps, for the layer's window keys (`caches.key_views`), the queries ``(B, S, H, D)`` it
    received (post-RoPE), the scale and sinks, and, where the layer reads pooled keys, the
    groups the indexer chose: rows as wide as the model's ``index_topk``, a group it did not
    choose or a row narrower than that filled with groups not yet whole (the selection then
    names exactly the groups the call read, SPEC 10.1, 1.8)."""

    def __init__(self, recorder: QueryRecorder, prompt_cache: list[Any], model: Any) -> None:
        from .caches import compressed_attention

        self.recorder = recorder
        self.modules = compressed_attention(model)
        self.pooled: dict[int, Pooled] = {}
        self._call: tuple[Any, Any] | None = None  # (module, LayerCache) of the call in progress
        self._saved: list[tuple[Any, str, Any]] = []
        if not self.modules:
            return
        count = len(prompt_cache)
        self._layer_of = {id(cache): index for index, cache in enumerate(prompt_cache)}
        self._caches = prompt_cache
        # File layers (`caches.key_views`): each layer's window after the model's layers, then
        # the groups of each layer that pools its own keys, in layer order.
        sources = [i for i, m in enumerate(self.modules) if m.is_kv_source and int(m.ratio) > 0]
        self._group_layer = {source: 2 * count + n for n, source in enumerate(sources)}
        # The layer whose groups a compressing layer reads: the last source up to it (mlx-lm's
        # ``_shared_reads``); None for a window alone.
        self._source_of = {
            layer: max((s for s in sources if s <= layer), default=None) if int(m.ratio) else None
            for layer, m in enumerate(self.modules)
        }
        self._window_layer = {index: count + index for index in range(count)}
        self.top_k = int(getattr(getattr(model, "args", None), "index_topk", 0) or 0)

    def install(self) -> None:
        if not self.modules:
            return
        module = sys.modules[type(self.modules[0]).__module__]
        kind = type(self.modules[0])
        call, sparse = kind.__call__, getattr(module, "_sparse_attention")  # noqa: B009
        self._saved = [(kind, "__call__", call), (module, "_sparse_attention", sparse)]

        @functools.wraps(call)
        def attention(attn: Any, *args: Any, **kwargs: Any) -> Any:
            before, self._call = self._call, (attn, kwargs.get("cache"))
            try:
                return call(attn, *args, **kwargs)
            finally:
                self._call = before

        @functools.wraps(sparse)
        def sparse_attention(q: mx.array, kvs: list[mx.array], indices: list[mx.array], **kwargs: Any) -> Any:
            self._record(q, kvs, indices, kwargs["sinks"], float(kwargs["scale"]))
            return sparse(q, kvs, indices, **kwargs)

        kind.__call__ = attention
        setattr(module, "_sparse_attention", sparse_attention)  # noqa: B010 - a model module

    def remove(self) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()

    def _record(
        self, q: mx.array, kvs: list[mx.array], indices: list[mx.array], sinks: Any, scale: float
    ) -> None:
        if self._call is None:
            raise CaptureError(
                "queries: deepseek_v41's sparse attention ran outside an attention module's call"
            )
        attn, cache = self._call
        layer = self._layer_of.get(id(cache))
        if layer is None:
            raise CaptureError(
                "queries: a deepseek_v41 attention call read a cache that is not a layer of the prompt cache"
            )
        window = self._window_layer[layer]
        end = int(cache.offset)
        self.recorder._keep(window, q.transpose(0, 2, 1, 3), _Offset(end), scale, sinks, None)
        ratio, source = int(attn.ratio), self._source_of[layer]
        if source is None:  # a window alone (or no layer pools keys before it): no pooled keys
            return
        if len(kvs) > 1 and kvs[1] is not self._caches[source].compress_kv:
            raise CaptureError(
                f"queries: deepseek_v41 layer {layer} read pooled keys that are not layer {source}'s; "
                "capture without --queries"
            )
        self.pooled[window] = Pooled(self._group_layer[source], ratio)
        length = int(q.shape[1])
        whole = (end - length + 1 + mx.arange(length)) // ratio  # groups whole at each position
        chosen = indices[1] if len(indices) > 1 else mx.zeros((q.shape[0], length, 0), mx.int32)
        width = max(self.top_k, int(chosen.shape[-1]))
        slots = mx.arange(width)
        fillers = whole[None, :, None] + slots  # distinct groups not yet whole, one per slot
        padded = mx.concatenate([chosen, fillers[..., chosen.shape[-1] :]], axis=-1)
        rows = mx.where(padded >= 0, padded, fillers).astype(mx.int32)
        self.recorder._select(window, _Offset(end), length, (width, rows[:, None]))


class _RopeTap:
    """Stands in for an MLA module's ``rope`` while queries are recorded: returns exactly what it
    returns, and hands the recorder each result (the query part first, then the key part)."""

    def __init__(self, recorder: QueryRecorder, module: Any, rope: Any) -> None:
        self.recorder, self.module, self.rope = recorder, module, rope

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.rope(x, *args, **kwargs)
        self.recorder._rope_out.append((self.module, out))
        return out


class _IndexerTap:
    """Stands in for a sparse-attention module's ``indexer`` (DeepSeek-V3.2, GLM-5) while queries
    are recorded: returns exactly what it returns (the top-k key positions of each query, or None
    where the cache holds no more keys than its top-k), and hands the recorder its top-k and
    that result, for the attention call that follows."""

    def __init__(self, recorder: QueryRecorder, indexer: Any) -> None:
        self.recorder, self.indexer = recorder, indexer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.indexer(*args, **kwargs)
        self.recorder._chosen = (int(self.indexer.index_topk), out)
        return out


def _read_keys(layer: int, rope_keys: mx.array, read: int, chosen: Any) -> mx.array:
    """The RoPE keys ``(batch, 1, n, dim)`` an MLA call that read ``read`` keys scored: all of
    them, or those a sparse decode call gathered (``chosen``: its indexer's ``(batch, 1, 1, k)``
    top-k); `CaptureError` where it read fewer keys and no indexer chose them."""
    if read == rope_keys.shape[2]:
        return rope_keys
    if chosen is None or chosen.shape[2] != 1 or chosen.shape[-1] != read:
        raise CaptureError(
            f"queries: layer {layer}'s attention reads {read} of its {rope_keys.shape[2]} keys, "
            "chosen by no indexer kvsnap sees; capture without --queries"
        )
    at = chosen[:, :, 0, :, None]
    return mx.take_along_axis(rope_keys, mx.broadcast_to(at, (*at.shape[:-1], rope_keys.shape[-1])), axis=2)


def _indexers(model: Any) -> list[Any]:
    """The model's attention modules whose ``indexer`` picks each query's keys (a top-k over an
    indexer's own key cache: DeepSeek-V3.2-style sparse attention)."""
    if model is None:
        return []
    return [
        module
        for module in model.modules()
        if isinstance(getattr(getattr(module, "indexer", None), "index_topk", None), int)
        and type(module).__module__ != "mlx_lm.models.deepseek_v41"  # recorded by its own call
    ]


class CallTap:
    """Stands in for a callable (a module's ``rope``, ``o_proj``) for one call: returns what it
    returns, appending its output to ``outputs`` and its first argument to ``inputs``."""

    def __init__(self, function: Any, outputs: list[Any], inputs: list[Any] | None = None) -> None:
        self.function, self.outputs, self.inputs = function, outputs, inputs

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.function(x, *args, **kwargs)
        self.outputs.append(out)
        if self.inputs is not None:
            self.inputs.append(x)
        return out


class _QueryPartTap:
    """Stands in for the query projection of an MLA module without RoPE (Kimi-Linear's, Kimi-K3's
    NoPE latent attention) while queries are recorded: returns exactly what it returns, and hands
    the recorder the part of each head that scores the cached position keys (its last
    ``qk_rope_head_dim`` channels, unrotated), as `_RopeTap` hands the RoPE'd part."""

    def __init__(self, recorder: QueryRecorder, module: Any, projection: Any) -> None:
        self.recorder, self.module, self.projection = recorder, module, projection

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.projection(x, *args, **kwargs)
        module = self.module
        batch, length = out.shape[0], out.shape[1]
        heads = out.reshape(batch, length, module.num_heads, -1).transpose(0, 2, 1, 3)
        self.recorder._rope_out.append((module, heads[..., module.qk_nope_head_dim :]))
        return out


def _query_projection(module: Any) -> str:
    """The name of an MLA module's last query projection: ``q_b_proj`` after a low-rank query,
    else ``q_proj``."""
    return "q_b_proj" if hasattr(module, "q_b_proj") else "q_proj"


def _latent_modules(model: Any) -> list[Any]:
    """The model's MLA attention modules in absorbed form: a ``kv_lora_rank``, ``embed_q`` and
    a ``rope``, or without one (NoPE), a ``qk_nope_head_dim`` split of the query projection's
    heads whose rest scores the cached position keys."""
    if model is None:
        return []
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "kv_lora_rank", None), int)
        and hasattr(module, "embed_q")
        and (
            hasattr(module, "rope")
            or (
                isinstance(getattr(module, "qk_nope_head_dim", None), int)
                and isinstance(getattr(module, "qk_rope_head_dim", None), int)
                and module.qk_rope_head_dim > 0
                and isinstance(getattr(module, "num_heads", None), int)
            )
        )
    ]


def _sinks(sinks: Any) -> tuple[float, ...] | None:
    """A layer's sink logits (an mlx array, one a query head) as a tuple, or None."""
    if sinks is None:
        return None
    return tuple(float(x) for x in np.array(sinks.astype(mx.float32)).reshape(-1).tolist())


def _visibility(attributes: dict[str, Any]) -> dict[str, Any]:
    """`QuerySpec`'s ``window``, ``keep`` and ``chunk`` from a layer's attributes (a sliding
    window and its kept prefix, a chunked layer's block size)."""
    kind = attributes.get("kind")
    window = attributes.get("window") if kind == "sliding" else None
    chunk = attributes.get("chunk_size") if kind == "chunked" else None
    return {
        "window": int(window) if window else None,
        "keep": int(attributes.get("keep") or 0) if window else 0,
        "chunk": int(chunk) if chunk else None,
    }


def _end_of(layer: int, cache: Any) -> int:
    """One past the last position of ``cache`` (after ``update_and_fetch``); `CaptureError` for a
    cache with per-sequence offsets."""
    end = getattr(cache, "offset", None)
    if not isinstance(end, int):
        raise CaptureError(
            f"layer {layer}: queries of a {type(cache).__name__} (per-sequence offsets) are not captured"
        )
    return end


def _kv_heads_of(layer: int, queries: mx.array, keys: Any, cache: Any) -> tuple[int, ...] | None:
    """Which cached KV head each query head reads, where the model handed attention its keys in
    another head layout than the cache holds (plamo tiles K/V across query heads: the keys
    attention receives are the cache's heads repeated as a whole, not each head in a run); None
    where the keys are the cache's heads (grouped-query attention: runs of query heads)."""
    if not isinstance(keys, mx.array) or not isinstance(getattr(cache, "keys", None), mx.array):
        return None
    held = cache.keys
    handed, stored = int(keys.shape[1]), int(held.shape[1])
    if handed == stored or handed % stored:
        return None
    end = int(cache.offset)
    last_handed = np.array(keys[0, :, -1].astype(mx.float32))  # (handed, dim)
    last_held = np.array(held[0, :, end - 1].astype(mx.float32))  # (stored, dim)
    source = []
    for row in last_handed:
        match = [j for j in range(stored) if np.array_equal(row, last_held[j])]
        if len(match) != 1:
            raise CaptureError(
                f"queries: layer {layer} hands attention keys that are not its cached heads (it "
                "computes them anew, not from the cache); capture without --queries"
            )
        source.append(match[0])
    per = max(1, int(queries.shape[1]) // handed)
    return tuple(source[h // per] for h in range(int(queries.shape[1])))


def _readers_side_by_side(layer: int, seen: _Layer) -> list[mx.array]:
    """A layer's pending query pieces, with each further reader's (a layer sharing its K/V) as
    the next block of query heads of the same piece; the readers' pending lists are emptied."""
    arrays = [array for array, _ in seen.pending]
    if seen.groups == 1:
        return arrays
    if any([f for _, f in extra] != [f for _, f in seen.pending] for extra in seen.extra):
        raise CaptureError(f"queries: layer {layer}'s readers ran on different positions")
    joined = [
        mx.concatenate([array, *(extra[i][0] for extra in seen.extra)], axis=1)
        for i, array in enumerate(arrays)
    ]
    seen.extra = [[] for _ in seen.extra]
    return joined


def _positions(pending: list[tuple[mx.array, int]]) -> np.ndarray:
    """The positions ``(n,)`` int64 of a layer's pending query pieces ``(array, first position)``,
    each ``(batch, heads, count, dim)``, in order."""
    first, count = pending[0][1], sum(array.shape[2] for array, _ in pending)
    if all(b == a + x.shape[2] for (x, a), (_, b) in itertools.pairwise(pending)):
        return np.arange(first, first + count, dtype=np.int64)
    return np.concatenate([np.arange(a, a + x.shape[2], dtype=np.int64) for x, a in pending])
