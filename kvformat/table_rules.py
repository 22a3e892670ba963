"""The chunk table checked against the spec and the manifest (SPEC section 12), in bulk.

`check_table` runs `RULES` in order; each rule is a small function of `TableFacts` (the table's
columns, copied out once, and per-layer lookup tables) returning ``None`` or the message of the
error it raises. The order matters: limits and sizes are checked before anything trusts them.
No rule loops over chunks in Python.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from kvformat import codecs, dtypes
from kvformat.errors import CorruptFileError, KVFormatError, LimitExceededError
from kvformat.layout import (
    ALIGN,
    DESCRIPTOR_MAGIC,
    DESCRIPTOR_SIZE,
    HEADER_SIZE,
    KIND_ARRAY,
    KIND_K,
    KIND_Q,
    KIND_SELECTION,
    KIND_V,
    MAX_CHUNK_DECODED,
    MAX_POSITION,
    MAX_TOKENS_PER_CHUNK,
    MAX_WIDTH,
    TABLE_KINDS,
)
from kvformat.manifest import Manifest


class TableFacts:
    """A chunk table (``DESCRIPTOR_DTYPE`` records) with what the rules compute from it, each
    computed once on first use."""

    def __init__(self, table: np.ndarray, index_offset: int, manifest: Manifest) -> None:
        self.table = table
        self.index_offset = index_offset
        self.manifest = manifest
        self._columns: dict[str, np.ndarray] = {}

    # The fields the rules read, copied out together on first use: block by block, so each
    # block of the table is read from memory once (one strided copy per field over the whole
    # table reads all of it again each time; `python -m benchmarks.format_bench --series`).
    _FIELDS = (
        "kind", "dtype", "codec", "flags", "layer", "head", "seq", "position",
        "rows", "width", "offset", "stored_size", "decoded_size",
    )  # fmt: skip
    _BLOCK = 8192  # records (512 KiB) per block

    def __getitem__(self, name: str) -> np.ndarray:
        """A field as a contiguous array (operations on a strided field of 64-byte records cost
        several times more, and the rules reuse them)."""
        if not self._columns:
            table, n = self.table, len(self.table)
            self._columns = {field: np.empty(n, table.dtype[field]) for field in self._FIELDS}
            for start in range(0, n, self._BLOCK):
                block = table[start : start + self._BLOCK]
                for field, copy in self._columns.items():
                    copy[start : start + self._BLOCK] = block[field]
        column = self._columns.get(name)
        if column is None:
            column = self._columns[name] = np.ascontiguousarray(self.table[name])
        return column

    @functools.cached_property
    def ends(self) -> np.ndarray:
        """Where each chunk's payload ends, ``(n,)`` int64."""
        return self["offset"].astype(np.int64) + DESCRIPTOR_SIZE + self["stored_size"].astype(np.int64)

    @functools.cached_property
    def rows(self) -> np.ndarray:
        return self["rows"].astype(np.int64)

    @functools.cached_property
    def width(self) -> np.ndarray:
        return self["width"].astype(np.int64)

    @functools.cached_property
    def layer(self) -> np.ndarray:
        return self["layer"].astype(np.int64)

    @functools.cached_property
    def is_array(self) -> np.ndarray:
        return self["kind"] == KIND_ARRAY

    @functools.cached_property
    def is_query(self) -> np.ndarray:
        return self["kind"] == KIND_Q

    @functools.cached_property
    def is_selection(self) -> np.ndarray:
        return self["kind"] == KIND_SELECTION

    @functools.cached_property
    def located(self) -> np.ndarray:
        """K, V, Q and selection chunks: those that name a layer, head and sequence (not arrays)."""
        return ~self.is_array

    @functools.cached_property
    def tensor(self) -> np.ndarray:
        """K or V chunks (not arrays, queries or selections)."""
        return ~self.is_array & ~self.is_query & ~self.is_selection

    @functools.cached_property
    def of(self) -> np.ndarray:
        """Each chunk's layer as an index into the per-layer tables (0 for arrays)."""
        return np.where(self.located, self.layer, 0)

    @functools.cached_property
    def side(self) -> np.ndarray:
        """0 for K (and arrays), 1 for V."""
        return np.where(self["kind"] == KIND_V, 1, 0)

    @functools.cached_property
    def per_layer(self) -> _LayerTables:
        return _LayerTables(self.manifest)

    @functools.cached_property
    def row_bytes(self) -> np.ndarray:
        """Bytes per decoded row of each chunk: width x itemsize, or the quantized row size."""
        itemsizes = np.zeros(256, dtype=np.int64)
        for code in np.flatnonzero(np.bincount(self["dtype"], minlength=256)).tolist():
            itemsizes[code] = dtypes.from_code(code).itemsize
        row_bytes = self.width * itemsizes[self["dtype"]]
        quantized_row_bytes = self.per_layer.quantized_row_bytes
        quantized = self.tensor & (quantized_row_bytes[self.of, self.side] > 0)
        row_bytes[quantized] = quantized_row_bytes[self.of[quantized], self.side[quantized]]
        return row_bytes


class _LayerTables:
    """Per-layer facts of the manifest as arrays indexed by layer (a chunk's layer looks its
    own up without a loop over chunks)."""

    def __init__(self, manifest: Manifest) -> None:
        layers = manifest.layers
        count = max(len(layers), 1)
        self.present = np.zeros(count, bool)
        self.heads = np.zeros(count, np.int64)
        self.dims = np.zeros((count, 2), np.int64)  # k_dim, v_dim
        self.dtype_codes = np.zeros(count, np.int64)
        self.quantized_row_bytes = np.zeros((count, 2), np.int64)  # 0: not quantized
        self.query_heads = np.zeros(count, np.int64)  # 0: the layer declares no queries
        self.query_dims = np.zeros(count, np.int64)
        self.query_dtype_codes = np.zeros(count, np.int64)
        self.selection_widths = np.zeros(count, np.int64)  # 0: the layer has no key selections
        for index, spec in enumerate(layers):
            if not spec.present:
                continue
            if spec.queries is not None:
                self.selection_widths[index] = spec.queries.selection or 0
                self.query_heads[index] = spec.queries.num_heads
                self.query_dims[index] = spec.queries.dim
                self.query_dtype_codes[index] = spec.queries.dtype.code
            assert spec.dtype is not None
            self.present[index], self.heads[index] = True, spec.num_heads
            self.dtype_codes[index] = spec.dtype.code
            self.dims[index] = spec.k_dim, spec.v_dim
            if spec.quantization is not None:
                self.quantized_row_bytes[index] = spec.row_bytes(KIND_K), spec.row_bytes(KIND_V)


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


# -- the rules, in the order they run ------------------------------------------------------


def magic(t: TableFacts) -> str | None:
    word = np.frombuffer(DESCRIPTOR_MAGIC, "<u4")[0]
    if not bool(np.all(t.table.view("<u4")[::16] == word)):  # the first 4 bytes of each
        return "chunk table entry without descriptor magic"
    return None


def kind(t: TableFacts) -> str | None:
    unknown = t["kind"] > max(TABLE_KINDS)  # kinds 0 .. 4
    return f"chunk table entry {_first(unknown)} has an unknown kind" if unknown.any() else None


def flags(t: TableFacts) -> str | None:
    return "chunk flags must be zero in version 1" if t["flags"].any() else None


def inside_the_records(t: TableFacts) -> str | None:
    if bool(np.any(t["stored_size"] > t.index_offset)) or bool(np.any(t["offset"] > t.index_offset)):
        return "chunk offset or size points past the index"
    return None


def aligned(t: TableFacts) -> str | None:
    offsets = t["offset"]
    if bool(np.any(offsets % ALIGN)) or int(offsets[0]) < HEADER_SIZE:
        return "chunk descriptor offset is not 64-aligned after the header"
    return None


def in_file_order(t: TableFacts) -> str | None:
    starts = t["offset"][1:].astype(np.int64)
    early = starts < t.ends[:-1]
    if early.any():
        i = _first(early)
        return f"chunks {i} and {i + 1} overlap or are out of file order"
    return None


def before_the_index(t: TableFacts) -> str | None:
    return "last chunk runs into the index" if int(t.ends[-1]) > t.index_offset else None


def shape_limits(t: TableFacts) -> str | None:
    if bool(np.any(t.rows > MAX_TOKENS_PER_CHUNK)) or bool(np.any(t.width > MAX_WIDTH)):
        return "chunk rows or width exceed the spec limits"
    return None


def positions(t: TableFacts) -> str | None:
    position = t["position"]
    # ``position > 2^53 - rows``, not ``position + rows > 2^53``: the sum wraps near 2^63
    if bool(np.any(position < 0)) or bool(np.any(position > MAX_POSITION - t.rows.astype(np.int64))):
        return "chunk positions outside 0..2**53-1"
    return None


def known_codecs_and_dtypes(t: TableFacts) -> str | None:
    """Raises the codec's or dtype's own `UnsupportedFeatureError` for an unknown code."""
    for code in np.flatnonzero(np.bincount(t["codec"], minlength=256)).tolist():
        codecs.from_code(code)
    for code in np.flatnonzero(np.bincount(t["dtype"], minlength=256)).tolist():
        dtypes.from_code(code)
    return None


def decoded_limit(t: TableFacts) -> str | None:
    if bool(np.any(t["decoded_size"] > MAX_CHUNK_DECODED)):
        return f"a chunk decodes to more than {MAX_CHUNK_DECODED} bytes"
    return None


def declared_layer_and_seq(t: TableFacts) -> str | None:
    tensor = t.located
    if bool(np.any(t.layer[tensor] >= len(t.manifest.layers))) or bool(
        np.any(t["seq"][tensor] >= t.manifest.num_seqs)
    ):
        return "chunk names a layer or sequence the manifest does not declare"
    return None


def decoded_size(t: TableFacts) -> str | None:
    if not bool(np.all(t.rows * t.row_bytes == t["decoded_size"].astype(np.int64))):
        return "chunk decoded size is not rows x (bytes per row)"
    return None


def raw_sizes(t: TableFacts) -> str | None:
    raw = t["codec"] == codecs.Raw.code
    if not bool(np.all(t["stored_size"][raw] == t["decoded_size"][raw])):
        return "raw chunk stored size differs from its decoded size"
    return None


def array_fields(t: TableFacts) -> str | None:
    if any(bool(np.any(t[name][t.is_array])) for name in ("layer", "head", "seq")):
        return "array chunk with a non-zero layer, head or seq"
    if bool(np.any(t["position"][t.is_array])):
        return "array chunk with a non-zero position"
    return None


def present_layer(t: TableFacts) -> str | None:
    absent = t.located & ~t.per_layer.present[t.of]
    return f"chunk stored for absent layer {int(t.layer[absent][0])}" if absent.any() else None


def layer_agreement(t: TableFacts) -> str | None:
    layers, of = t.per_layer, t.of
    wrong = t.tensor & (
        (t["head"] >= layers.heads[of])
        | (t.width != layers.dims[of, t.side])
        | (t["dtype"] != layers.dtype_codes[of])
    )
    if wrong.any():
        return f"chunk of layer {int(t.layer[wrong][0])} disagrees with the layer's heads, dims or dtype"
    return None


def query_agreement(t: TableFacts) -> str | None:
    """Q chunks (1.3): the layer declares queries; head, width and dtype are the queries'."""
    layers, of = t.per_layer, t.of
    wrong = t.is_query & (
        (t["head"] >= layers.query_heads[of])
        | (t.width != layers.query_dims[of])
        | (t["dtype"] != layers.query_dtype_codes[of])
    )
    if wrong.any():
        return (
            f"query chunk of layer {int(t.layer[wrong][0])} disagrees with the layer's queries "
            "(none declared, or their heads, dim or dtype)"
        )
    return None


def selection_agreement(t: TableFacts) -> str | None:
    """Selection chunks (1.7): the layer's queries declare a selection of this width; head 0,
    dtype int32."""
    layers, of = t.per_layer, t.of
    wrong = t.is_selection & (
        (t["head"] != 0)
        | (layers.selection_widths[of] == 0)
        | (t.width != layers.selection_widths[of])
        | (t["dtype"] != dtypes.INT32.code)
    )
    if wrong.any():
        return (
            f"selection chunk of layer {int(t.layer[wrong][0])} disagrees with the layer's queries "
            "(no selection declared, or its width), or has a head other than 0 or a dtype other than int32"
        )
    return None


Rule = Callable[[TableFacts], "str | None"]

RULES: list[tuple[type[KVFormatError], Rule]] = [
    (CorruptFileError, magic),
    (CorruptFileError, kind),
    (CorruptFileError, flags),
    (CorruptFileError, inside_the_records),
    (CorruptFileError, aligned),
    (CorruptFileError, in_file_order),
    (CorruptFileError, before_the_index),
    (LimitExceededError, shape_limits),
    (CorruptFileError, positions),
    (CorruptFileError, known_codecs_and_dtypes),
    (LimitExceededError, decoded_limit),
    (CorruptFileError, declared_layer_and_seq),
    (CorruptFileError, decoded_size),
    (CorruptFileError, raw_sizes),
    (CorruptFileError, array_fields),
    (CorruptFileError, present_layer),
    (CorruptFileError, layer_agreement),
    (CorruptFileError, query_agreement),
    (CorruptFileError, selection_agreement),
]
"""(the error a failing rule raises, the rule), in the order they run."""


def check_table(table: np.ndarray, index_offset: int, manifest: Manifest) -> None:
    """Check every descriptor of ``table`` against the spec and ``manifest``: the first rule
    that fails raises its error."""
    if len(table) == 0:
        return
    facts = TableFacts(table, index_offset, manifest)
    for error, rule in RULES:
        message = rule(facts)
        if message is not None:
            raise error(message)
