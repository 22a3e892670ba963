"""The JSON side of a file: the manifest (layer descriptors, features, metadata) and the
snapshot records (parent, drops, appended chunks, metadata, arrays).

Everything here is plain JSON (UTF-8, no NaN). Parsing is strict about types and sizes, since the
JSON decides how the binary chunk table is interpreted.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from kvformat import dtypes, quantization
from kvformat.dtypes import DType
from kvformat.errors import CorruptFileError, InvalidLayoutError, LimitExceededError, UnsupportedFeatureError
from kvformat.layout import MAX_HEAD_SEQUENCES, MAX_HEADS, MAX_LAYERS, MAX_POSITION, MAX_SEQS, MAX_WIDTH
from kvformat.quantization import Quantization

# Features this implementation understands (SPEC section 14): 1.2 defines "append-chunks", 1.3
# "queries", 1.6 "chunked-attention" and "latent-attention", 1.7 "sparse-attention", 1.8
# "pooled-attention"; a file that lists an unknown name under "required_features" is rejected.
QUERIES = "queries"
CHUNKED_ATTENTION = "chunked-attention"
LATENT_ATTENTION = "latent-attention"
SPARSE_ATTENTION = "sparse-attention"
POOLED_ATTENTION = "pooled-attention"
KNOWN_FEATURES: frozenset[str] = frozenset(
    {"append-chunks", QUERIES, CHUNKED_ATTENTION, LATENT_ATTENTION, SPARSE_ATTENTION, POOLED_ATTENTION}
)


@dataclass(frozen=True)
class Pooled:
    """Pooled keys a layer's queries also read (format 1.8, DeepSeek-V4.1's compressed
    attention): layer ``layer``'s row at position ``g`` pools the ``ratio`` token positions from
    ``g * ratio``, and a query at ``p`` sees it once its group is whole, ``(g + 1) * ratio <= p + 1``."""

    layer: int
    ratio: int

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "ratio": self.ratio}


@dataclass(frozen=True)
class QuerySpec:
    """A layer's queries (format 1.3, SPEC section 10.1) and what attention did with them.

    ``num_heads`` query heads of ``dim`` elements in ``dtype``; query head ``h`` attends KV head
    ``kv_heads[h]``. Attention logits are ``scale * q.k`` (then ``softcap * tanh(x / softcap)``
    when ``softcap`` is set), over the keys at positions ``j <= p`` for a query at ``p`` (causal),
    and with a ``window`` only those with ``p - j < window - keep`` or ``j < keep``; with a
    ``chunk`` (1.6, chunked attention as Llama 4's local layers) only those in the query's block
    of ``chunk`` positions, ``j // chunk == p // chunk``. ``sinks``: one logit per query head that
    joins the softmax's denominator (learned attention sinks), or None. ``latent`` (1.6, multi-head
    latent attention in absorbed form): the layer's K slot holds the latent ``c_j`` and its V
    slot the shared RoPE key ``r_j``; a query ``[q_c; q_r]`` (``dim = k_dim + v_dim``) has logits
    ``scale * (q_c . c_j + q_r . r_j)`` and output ``sum_j w_j c_j`` (``k_dim`` wide).
    ``selection`` (1.7, sparse attention as DeepSeek-V3.2's indexer chooses keys): the width of
    the layer's selection rows; a query with a row sees only the visible keys its row names
    (one row per position, shared by every query head), a query without one every visible key.
    ``pooled`` (1.8, DeepSeek-V4.1): besides its own layer's visible keys, a query reads the
    whole groups of another layer's pooled keys (`Pooled`), one softmax over both; a selection
    row then names pooled keys (the indexer's top-k groups), never the layer's own."""

    num_heads: int
    dim: int
    dtype: DType
    scale: float
    kv_heads: tuple[int, ...]
    window: int | None = None
    keep: int = 0
    softcap: float | None = None
    sinks: tuple[float, ...] | None = None
    chunk: int | None = None
    latent: bool = False
    selection: int | None = None
    pooled: Pooled | None = None

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "num_heads": self.num_heads,
            "dim": self.dim,
            "dtype": self.dtype.name,
            "scale": self.scale,
            "kv_heads": list(self.kv_heads),
            "window": self.window,
            "keep": self.keep,
            "softcap": self.softcap,
            "sinks": list(self.sinks) if self.sinks is not None else None,
        }
        if self.chunk is not None:  # written only where set: files without it are 1.5's bytes
            document["chunk"] = self.chunk
        if self.latent:
            document["latent"] = True
        if self.selection is not None:
            document["selection"] = self.selection
        if self.pooled is not None:
            document["pooled"] = self.pooled.to_json()
        return document

    def check(self, kv_heads: int, dims: tuple[int, int] | None = None) -> None:
        """Raise ValueError for a description a writer must not declare (``kv_heads``: the
        layer's KV head count; ``dims``: its K and V head dims, for a latent layer's ``dim``)."""
        for name, value, limit in (("num_heads", self.num_heads, MAX_HEADS), ("dim", self.dim, MAX_WIDTH)):
            if not _is_int(value) or not 1 <= value <= limit:
                raise InvalidLayoutError(f"queries {name} must be an integer in 1..{limit}, got {value!r}")
        if len(self.kv_heads) != self.num_heads or not all(
            _is_int(h) and 0 <= h < kv_heads for h in self.kv_heads
        ):
            raise InvalidLayoutError(
                f"queries kv_heads must name one KV head (0..{kv_heads - 1}) per query head"
            )
        self._check_mask()
        self._check_logits()
        self._check_latent(dims)
        self._check_selection()
        self._check_pooled()

    def _check_pooled(self) -> None:
        """``pooled`` null or a layer in ``0 .. 2^16`` and a ratio in ``1 .. 2^53``; never with
        latent attention."""
        if self.pooled is None:
            return
        layer, ratio = self.pooled.layer, self.pooled.ratio
        if not (_is_int(layer) and 0 <= layer < MAX_LAYERS and _is_int(ratio) and 1 <= ratio <= MAX_POSITION):
            raise InvalidLayoutError(
                f"queries pooled must name a layer in 0..{MAX_LAYERS - 1} and a ratio in 1..2^53, got "
                f"{self.pooled.to_json()}"
            )
        if self.latent:
            raise InvalidLayoutError("queries pooled and latent cannot both be set")

    def _check_selection(self) -> None:
        """``selection`` null or a row width in ``1 .. 2^20``."""
        if self.selection is not None and (
            not _is_int(self.selection) or not 1 <= self.selection <= MAX_WIDTH
        ):
            raise InvalidLayoutError(f"queries selection must be null or an integer in 1..{MAX_WIDTH}")

    def _check_latent(self, dims: tuple[int, int] | None) -> None:
        """``latent`` a boolean; a latent layer's ``dim`` its K and V head dims together."""
        if not isinstance(self.latent, bool):
            raise InvalidLayoutError(f"queries latent must be true or false, got {self.latent!r}")
        if self.latent and dims is not None and self.dim != dims[0] + dims[1]:
            raise InvalidLayoutError(
                f"latent queries must have dim k_dim + v_dim = {sum(dims)}, got {self.dim}"
            )

    def _check_logits(self) -> None:
        """``scale`` finite and positive, ``softcap`` null or so, ``sinks`` null or one finite
        number per query head."""
        if not (isinstance(self.scale, float | int) and math.isfinite(self.scale) and self.scale > 0):
            raise InvalidLayoutError(f"queries scale must be a finite number above 0, got {self.scale!r}")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise InvalidLayoutError(
                f"queries softcap must be null or a finite number above 0, got {self.softcap!r}"
            )
        if self.sinks is not None and (len(self.sinks) != self.num_heads or not _finite(self.sinks)):
            raise InvalidLayoutError("queries sinks must be null or one finite number per query head")

    def _check_keep(self) -> None:
        """``keep`` an integer >= 0, below the window where there is one."""
        if not _is_int(self.keep) or self.keep < 0:
            raise InvalidLayoutError(f"queries keep must be an integer >= 0, got {self.keep!r}")
        if self.window is not None and self.keep >= self.window:
            raise InvalidLayoutError(f"queries keep ({self.keep}) must be below the window ({self.window})")

    def _check_mask(self) -> None:
        """``window`` and ``chunk`` null or positive (not both), ``keep`` an integer >= 0 and
        below the window."""
        for name, value in (("window", self.window), ("chunk", self.chunk)):
            if value is not None and (not _is_int(value) or not 1 <= value <= MAX_POSITION):
                raise InvalidLayoutError(
                    f"queries {name} must be null or an integer in 1..2^53, got {value!r}"
                )
        self._check_keep()
        if self.chunk is not None and self.window is not None:
            raise InvalidLayoutError("queries chunk and window cannot both be set")


def _finite(values: tuple[float, ...]) -> bool:
    return all(math.isfinite(x) for x in values)


def _double(value: int | float, what: str) -> float:
    """A JSON number as a double; an integer no double holds (``10**400``, which Python reads
    exactly) is corrupt, as ``1e400`` is (SPEC section 2)."""
    try:
        return float(value)
    except OverflowError:
        digits = str(value) if abs(value) < 10**60 else f"an integer of {len(str(abs(value)))} digits"
        raise CorruptFileError(f"{what}: {digits} is out of the range of a double") from None


def _is_int(value: Any) -> bool:
    """An integer, not a bool (JSON's true is no head count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _query_lists(obj: dict[str, Any], where: str) -> tuple[list[Any], list[Any] | None, int | None]:
    """A ``queries`` object's ``kv_heads`` (a list), ``sinks`` (null or numbers) and ``window``
    (null or an integer), type-checked; values are `QuerySpec.check`'s."""
    kv = obj.get("kv_heads")
    sinks = obj.get("sinks")
    window = obj.get("window")
    if not isinstance(kv, list) or (sinks is not None and not isinstance(sinks, list)):
        raise CorruptFileError(f"{where} queries: 'kv_heads' must be a list, 'sinks' null or a list")
    if window is not None and not _is_int(window):
        raise CorruptFileError(f"{where} queries: 'window' must be null or an integer")
    if sinks is not None and not all(isinstance(x, int | float) and not isinstance(x, bool) for x in sinks):
        raise CorruptFileError(f"{where} queries: 'sinks' must hold numbers")
    return kv, sinks, window


def _keep(obj: dict[str, Any], where: str) -> int:
    """A ``queries`` object's ``keep``: absent means 0; an integer in ``0 .. 2^53`` (a value
    outside section 10.1's rules: corrupt, not a limit)."""
    if "keep" not in obj:
        return 0
    value = obj["keep"]
    if not _is_int(value) or not 0 <= value <= MAX_POSITION:
        raise CorruptFileError(f"{where} queries: 'keep' must be an integer in 0..2^53, got {value!r}")
    return int(value)


def _optional_int(obj: dict[str, Any], key: str, where: str) -> int | None:
    """A ``queries`` object's ``chunk`` (1.6) or ``selection`` (1.7): absent or null means none;
    else an integer (its range is `QuerySpec.check`'s)."""
    value = obj.get(key)
    if value is not None and not _is_int(value):
        raise CorruptFileError(f"{where} queries: '{key}' must be null or an integer")
    return value


def _pooled(obj: dict[str, Any], where: str) -> Pooled | None:
    """A ``queries`` object's ``pooled`` (1.8): absent means none; else an object of two
    integers ``layer`` and ``ratio`` (their ranges are `QuerySpec.check`'s; null is corrupt: the
    key is typed "object")."""
    if "pooled" not in obj:
        return None
    value = obj["pooled"]
    if not isinstance(value, dict) or not all(_is_int(value.get(key)) for key in ("layer", "ratio")):
        raise CorruptFileError(f"{where} queries: 'pooled' must be an object of integers 'layer' and 'ratio'")
    return Pooled(int(value["layer"]), int(value["ratio"]))


def _latent(obj: dict[str, Any], where: str) -> bool:
    """A ``queries`` object's ``latent`` (1.6): absent means false; else true or false."""
    value = obj.get("latent", False)
    if not isinstance(value, bool):
        raise CorruptFileError(f"{where} queries: 'latent' must be true or false")
    return value


ABSENT = object()
"""A key the JSON leaves out (where null is not the same: a key typed "object" holds one)."""


def parse_queries(
    obj: Any, where: str, kv_heads: int, dims: tuple[int, int] | None = None
) -> QuerySpec | None:
    """A layer's ``queries`` object (SPEC section 10.1), or None when the key is `ABSENT` (null is
    corrupt: the key is typed "object")."""
    if obj is ABSENT:
        return None
    if obj is None:
        raise CorruptFileError(f"{where}: 'queries' must be an object (leave the key out for none)")
    obj = _object(obj, f"{where} queries")
    name = obj.get("dtype")
    if not isinstance(name, str):
        raise CorruptFileError(f"{where} queries: 'dtype' must be a string")

    def number(key: str, optional: bool) -> float | None:
        value = obj.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise CorruptFileError(f"{where} queries: '{key}' must be a number, got {value!r}")
        return _double(value, f"{where} queries: '{key}'")

    kv, sinks, window = _query_lists(obj, where)
    scale = number("scale", False)
    assert scale is not None
    spec = QuerySpec(
        num_heads=_int(obj, "num_heads", 1, MAX_HEADS, f"{where} queries"),
        dim=_int(obj, "dim", 1, MAX_WIDTH, f"{where} queries"),
        dtype=dtypes.from_name(name),
        scale=scale,
        kv_heads=tuple(kv),
        window=window,
        keep=_keep(obj, where),
        softcap=number("softcap", True),
        sinks=tuple(_double(x, f"{where} queries: 'sinks'") for x in sinks) if sinks is not None else None,
        chunk=_optional_int(obj, "chunk", where),
        latent=_latent(obj, where),
        selection=_optional_int(obj, "selection", where),
        pooled=_pooled(obj, where),
    )
    try:
        spec.check(kv_heads, dims)
    except ValueError as exc:
        raise CorruptFileError(f"{where}: {exc}") from None
    return spec


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the model: its KV head count, K and V head dims (elements) and dtype.

    An absent layer (``present=False``) holds no K/V at all: recurrent layers of hybrid models,
    or layers that share another layer's cache. ``attributes`` is free JSON (layer kind, window).
    """

    num_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    dtype: DType | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    present: bool = True
    quantization: Quantization | None = None
    queries: QuerySpec | None = None  # format 1.3: the layer's queries and attention

    def row_bytes(self, kind: int) -> int:
        """Stored bytes per token row of K (kind 0) or V (kind 1) before any codec."""
        assert self.dtype is not None
        dim = self.k_dim if kind == 0 else self.v_dim
        if self.quantization is None:
            return dim * self.dtype.itemsize
        return self.quantization.row_bytes(dim, self.dtype.itemsize)

    @classmethod
    def absent(cls, attributes: dict[str, Any] | None = None) -> LayerSpec:
        return cls(present=False, attributes=dict(attributes or {}))

    def to_json(self) -> dict[str, Any]:
        if not self.present:
            return {"present": False, "attributes": self.attributes}
        assert self.dtype is not None
        document = {
            "present": True,
            "num_heads": self.num_heads,
            "k_dim": self.k_dim,
            "v_dim": self.v_dim,
            "dtype": self.dtype.name,
            "attributes": self.attributes,
        }
        if self.quantization is not None:
            document["quantization"] = self.quantization.to_json()
        if self.queries is not None:
            document["queries"] = self.queries.to_json()
        return document

    def check(self) -> None:
        """Raise ValueError for a layer a writer must not declare."""
        if not self.present:
            return
        if self.dtype is None:
            raise InvalidLayoutError("a present layer needs a dtype")
        for name, value, limit in (
            ("num_heads", self.num_heads, MAX_HEADS),
            ("k_dim", self.k_dim, MAX_WIDTH),
            ("v_dim", self.v_dim, MAX_WIDTH),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise InvalidLayoutError(f"layer {name} must be an integer in 1..{limit}, got {value!r}")
        if self.quantization is not None:
            self.quantization.check_dim(self.k_dim)
            self.quantization.check_dim(self.v_dim)
        if self.queries is not None:
            self.queries.check(self.num_heads, (self.k_dim, self.v_dim))


def _int(obj: dict[str, Any], key: str, low: int, high: int, where: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CorruptFileError(f"{where}: '{key}' must be an integer, got {value!r}")
    if not low <= value <= high:
        raise LimitExceededError(f"{where}: '{key}' = {value} outside {low}..{high}")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptFileError(f"{where} must be a JSON object")
    return value


def parse_layer(obj: Any, index: int) -> LayerSpec:
    where = f"layer {index}"
    obj = _object(obj, where)
    attributes = _object(obj.get("attributes", {}), f"{where} attributes")
    present = obj.get("present", True)
    if not isinstance(present, bool):
        raise CorruptFileError(f"{where}: 'present' must be true or false")
    if not present:
        return LayerSpec.absent(attributes)
    name = obj.get("dtype")
    if not isinstance(name, str):
        raise CorruptFileError(f"{where}: 'dtype' must be a string")
    num_heads = _int(obj, "num_heads", 1, MAX_HEADS, where)
    k_dim = _int(obj, "k_dim", 1, MAX_WIDTH, where)
    v_dim = _int(obj, "v_dim", 1, MAX_WIDTH, where)
    dtype = dtypes.from_name(name)
    if "quantization" in obj and obj["quantization"] is None:  # typed "object": null is no absence
        raise CorruptFileError(f"{where}: 'quantization' must be an object (leave the key out for none)")
    quantized = quantization.parse(obj.get("quantization"))
    if quantized is not None:  # before `queries` (SPEC 13.1)
        try:
            quantized.check_dim(k_dim)
            quantized.check_dim(v_dim)
        except ValueError as exc:
            raise CorruptFileError(f"{where}: {exc}") from None
    spec = LayerSpec(
        num_heads=num_heads,
        k_dim=k_dim,
        v_dim=v_dim,
        dtype=dtype,
        attributes=attributes,
        quantization=quantized,
        queries=parse_queries(obj.get("queries", ABSENT), where, num_heads, (k_dim, v_dim)),
    )
    try:
        spec.check()
    except ValueError as exc:
        raise CorruptFileError(f"{where}: {exc}") from None
    return spec


@dataclass
class Manifest:
    """File-level description: layers, number of sequences, features, metadata."""

    layers: list[LayerSpec]
    num_seqs: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    required_features: list[str] = field(default_factory=list)
    optional_features: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "num_seqs": self.num_seqs,
            "layers": [layer.to_json() for layer in self.layers],
            "required_features": self.required_features,
            "optional_features": self.optional_features,
            "metadata": self.metadata,
        }


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CorruptFileError(f"{where} must be a list of strings")
    return list(value)


def parse_manifest(obj: Any) -> Manifest:
    obj = _object(obj, "manifest")
    required = _strings(obj.get("required_features", []), "required_features")
    unknown = sorted(set(required) - KNOWN_FEATURES)
    if unknown:
        raise UnsupportedFeatureError(f"file requires features this reader lacks: {unknown}")
    layers_json = obj.get("layers")
    if not isinstance(layers_json, list):
        raise CorruptFileError("manifest 'layers' must be a list")
    if len(layers_json) > MAX_LAYERS:
        raise LimitExceededError(f"{len(layers_json)} layers; the limit is {MAX_LAYERS}")
    manifest = Manifest(
        layers=[parse_layer(layer, i) for i, layer in enumerate(layers_json)],
        num_seqs=_int(obj, "num_seqs", 1, MAX_SEQS, "manifest"),
        metadata=_object(obj.get("metadata", {}), "metadata"),
        required_features=required,
        optional_features=_strings(obj.get("optional_features", []), "optional_features"),
    )
    check_head_sequences(manifest.layers, manifest.num_seqs, LimitExceededError)
    _check_features_declared(manifest.layers, required)
    try:
        check_pooled_layers(manifest.layers)
    except ValueError as exc:
        raise CorruptFileError(str(exc)) from None
    return manifest


def check_pooled_layers(layers: list[LayerSpec]) -> None:
    """`InvalidLayoutError` unless every present layer whose queries read pooled keys names
    another present layer of as many KV heads and the same K and V head dims (SPEC 10.1, 1.8)."""
    for index, layer in enumerate(layers):
        pooled = layer.queries.pooled if layer.present and layer.queries is not None else None
        if pooled is None:
            continue
        source = layers[pooled.layer] if pooled.layer < len(layers) else None
        if (
            pooled.layer == index
            or source is None
            or not source.present
            or (source.num_heads, source.k_dim, source.v_dim) != (layer.num_heads, layer.k_dim, layer.v_dim)
        ):
            raise InvalidLayoutError(
                f"layer {index} queries: 'pooled' names layer {pooled.layer}, which is not another present "
                "layer of as many KV heads and the same K and V head dims"
            )


def _check_features_declared(layers: list[LayerSpec], required: list[str]) -> None:
    """`CorruptFileError` where the layers use queries, chunked, latent or sparse attention that
    ``required_features`` does not list (checked in that order)."""
    queries = [layer.queries for layer in layers if layer.queries is not None]
    for used, feature, what in (
        (bool(queries), QUERIES, "queries"),
        (any(q.chunk is not None for q in queries), CHUNKED_ATTENTION, "chunked attention"),
        (any(q.latent for q in queries), LATENT_ATTENTION, "latent attention"),
        (any(q.selection is not None for q in queries), SPARSE_ATTENTION, "sparse attention"),
        (any(q.pooled is not None for q in queries), POOLED_ATTENTION, "pooled attention"),
    ):
        if used and feature not in required:
            raise CorruptFileError(
                f"layers declare {what} but 'required_features' does not list \"{feature}\""
            )


def format_minor(manifest: Manifest) -> int:
    """The minor version a writer writes: 8 for a file with pooled keys (feature
    ``pooled-attention``), 7 for one with key selections (``sparse-attention``), 3 for a file
    with queries (``queries``), else 2, so that files without them stay byte for byte what a
    1.2, 1.3 or 1.7 writer writes."""
    if POOLED_ATTENTION in manifest.required_features:
        return 8
    if SPARSE_ATTENTION in manifest.required_features:
        return 7
    return 3 if QUERIES in manifest.required_features else 2


def check_head_sequences(layers: list[LayerSpec], num_seqs: int, error: type[Exception]) -> None:
    """At most `MAX_HEAD_SEQUENCES` (layer, head, sequence) triples, KV heads and query heads
    counted alike (SPEC section 10, 1.4): what bounds a description, a pass over heads, or a table
    of per-head statistics."""
    heads = sum(
        layer.num_heads + (layer.queries.num_heads if layer.queries is not None else 0)
        for layer in layers
        if layer.present
    )
    total = heads * num_seqs
    if total > MAX_HEAD_SEQUENCES:
        raise error(
            f"{total} (layer, KV or query head, sequence) triples declared; the limit is "
            f"{MAX_HEAD_SEQUENCES} (2^24)"
        )


def dumps(obj: Any) -> bytes:
    """Serialize to compact UTF-8 JSON; NaN and infinities are refused (they are not JSON)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidLayoutError(
            f"metadata must be plain JSON (dict, list, str, int, float, bool, None): {exc}"
        ) from None


def loads(data: bytes | memoryview, what: str) -> Any:
    """Parse UTF-8 JSON from a file, mapping every failure to `CorruptFileError`."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptFileError(f"{what} is not valid UTF-8: {exc}") from None
    try:
        value = _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise CorruptFileError(f"{what} is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise CorruptFileError(f"{what} holds an unpaired UTF-16 surrogate escape (SPEC section 2)")
    return value


# A \uD800-\uDFFF escape: only then can a parsed string hold a lone surrogate (a pair decodes to
# one character; raw surrogates cannot be valid UTF-8), so most files skip the walk below.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if any("\ud800" <= c <= "\udfff" for c in item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(x for x in item if isinstance(x, str | dict | list))
    return False


def _reject_constant(name: str) -> Any:
    # internal: `loads` maps it to CorruptFileError
    raise ValueError(f"{name} is not JSON")


def _json_float(text: str) -> float:
    """A JSON number with a fraction or exponent: refused when no double holds it (``1e400``:
    valid JSON text, but no reader can keep its value; SPEC section 2)."""
    value = float(text)
    if math.isinf(value):
        # internal: `loads` maps it to CorruptFileError
        raise ValueError(f"number {text} is out of the range of a double")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose names are unique (SPEC section 2: a duplicate name is an error, not "the
    last one wins", which readers in other languages do not agree on)."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                # internal: `loads` maps it to CorruptFileError
                raise ValueError(f"object holds the name {name!r} twice")
            seen.add(name)
    return value


_DECODER = json.JSONDecoder(
    parse_constant=_reject_constant, parse_float=_json_float, object_pairs_hook=_unique_keys
)  # one for all: json.loads makes one per call
