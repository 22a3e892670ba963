"""The JSON side of a file: the manifest (layer descriptors, features, metadata) and the
snapshot records (parent, drops, appended chunks, metadata, arrays).

Everything here is plain JSON (UTF-8, no NaN). Parsing is strict about types and sizes, since the
JSON decides how the binary chunk table is interpreted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvformat import dtypes, quantization
from kvformat.dtypes import DType
from kvformat.errors import CorruptFileError, LimitExceededError, UnsupportedFeatureError
from kvformat.layout import MAX_HEAD_SEQUENCES, MAX_HEADS, MAX_LAYERS, MAX_SEQS, MAX_WIDTH
from kvformat.quantization import Quantization

# Features this implementation understands (SPEC section 14): 1.2 defines "append-chunks"; a
# file that lists an unknown name under "required_features" is rejected.
KNOWN_FEATURES: frozenset[str] = frozenset({"append-chunks"})


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
        return document

    def check(self) -> None:
        """Raise ValueError for a layer a writer must not declare."""
        if not self.present:
            return
        if self.dtype is None:
            raise ValueError("a present layer needs a dtype")
        for name, value, limit in (
            ("num_heads", self.num_heads, MAX_HEADS),
            ("k_dim", self.k_dim, MAX_WIDTH),
            ("v_dim", self.v_dim, MAX_WIDTH),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise ValueError(f"layer {name} must be an integer in 1..{limit}, got {value!r}")
        if self.quantization is not None:
            self.quantization.check_dim(self.k_dim)
            self.quantization.check_dim(self.v_dim)


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
    spec = LayerSpec(
        num_heads=_int(obj, "num_heads", 1, MAX_HEADS, where),
        k_dim=_int(obj, "k_dim", 1, MAX_WIDTH, where),
        v_dim=_int(obj, "v_dim", 1, MAX_WIDTH, where),
        dtype=dtypes.from_name(name),
        attributes=attributes,
        quantization=quantization.parse(obj.get("quantization")),
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
    return manifest


def check_head_sequences(layers: list[LayerSpec], num_seqs: int, error: type[Exception]) -> None:
    """At most `MAX_HEAD_SEQUENCES` (layer, head, sequence) triples (SPEC section 10): what bounds
    a description, a pass over heads, or a table of per-head statistics."""
    total = sum(layer.num_heads for layer in layers if layer.present) * num_seqs
    if total > MAX_HEAD_SEQUENCES:
        raise error(
            f"{total} (layer, head, sequence) triples declared; the limit is {MAX_HEAD_SEQUENCES} (2^24)"
        )


def dumps(obj: Any) -> bytes:
    """Serialize to compact UTF-8 JSON; NaN and infinities are refused (they are not JSON)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(
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
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # one for all: json.loads makes one per call
