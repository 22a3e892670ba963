"""Import go-mlx ``MLXKV001`` snapshots (layout versions 1 to 6) into `.kv` files.

go-mlx's attention probe saves a KV snapshot with ``snap.Save(path)``: one little-endian stream
with no index and no checksums (``../shared/formats/mlxkv001.md`` records the layout). This
module reads it front to back in two passes over the source, never holding more than one layer:

1. **layout**: every header, count and tensor tag, with each length checked against the bytes
   left before anything is allocated; tensor payloads are skipped, their offsets remembered;
2. **data**: layer by layer, the payloads are read at those offsets, decoded and appended to a
   `kvformat.Writer` (``DST.partial``, renamed into place only when complete).

Mapping (what lands where in the `.kv` file):

- a per-head tensor of ``T`` rows holds the **last** ``T`` positions ``seq_len - T .. seq_len-1``
  (``T == seq_len`` for full attention); a whole-layer slab ``[B, H, L, D]`` or ``[L, H, D]``
  likewise, ``B`` becoming the file's sequences;
- element types are kept: float32 tensors (tag 0) as float32, native float16 / bfloat16 /
  float32 (tag 2) as themselves; q8 tensors (tag 1) become float32 ``int8 * scale``, exactly the
  values go-mlx's own decoder returns (the layer attribute ``source_encoding`` says so). A layer
  whose tensors mix types is stored as float32, which holds all of them exactly;
- ``tokens`` go to snapshot metadata ``tokens`` (one list per sequence), ``generated`` ids to
  ``generated_ids`` and their count to ``generated``, the last logits to the snapshot array
  ``last_logits`` ``(rows, vocab)`` float32 (their shape in ``last_logits_shape``);
- the file metadata records the architecture (``model``), and under ``source`` the format, its
  layout version, the file name, size and SHA-256.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from kvformat import dtypes, sniff
from kvformat.codecs import Codec
from kvformat.dtypes import DType
from kvformat.errors import (
    CorruptFileError,
    InvalidArgumentError,
    LimitExceededError,
    TruncatedFileError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
)
from kvformat.importers.contract import Imported, Importer
from kvformat.io.outputs import check_output
from kvformat.layout import MAX_HEADS, MAX_LAYERS, MAX_SEQS, MAX_WIDTH
from kvformat.manifest import LayerSpec
from kvformat.writer import Writer

MAGIC = sniff.MLXKV
VERSIONS = range(1, 7)
TAG_FLOAT32, TAG_Q8, TAG_NATIVE = 0, 1, 2
NATIVE_NAMES: dict[str, DType] = {
    "float32": dtypes.FLOAT32,
    "F32": dtypes.FLOAT32,
    "float16": dtypes.FLOAT16,
    "F16": dtypes.FLOAT16,
    "bfloat16": dtypes.BFLOAT16,
    "BF16": dtypes.BFLOAT16,
}
MAX_STRING = 1 << 20  # architecture, dtype and cache-mode names: far below this
MAX_PAYLOADS = 1 << 16  # opaque per-layer payloads (turboquant): a handful in practice
MAX_SEQ_LEN = 1 << 31
_HASH_BLOCK = 1 << 20


class _Stream:
    """Reads of a seekable file front to back; every length is checked against the bytes left
    before it is read or allocated, so a count of 2^31 in a small file is an error, not a
    2^31-element allocation."""

    def __init__(self, file: BinaryIO, size: int, name: str) -> None:
        self.file, self.size, self.name = file, size, name
        self.position = 0

    def left(self) -> int:
        return self.size - self.position

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise TruncatedFileError(
                f"{self.name}: MLXKV001 {what} needs {n} bytes at byte {self.position}, but the "
                f"file ends at byte {self.size} (truncated or corrupt)"
            )

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.file.read(n)
        if len(data) != n:  # the file shrank while being read
            raise TruncatedFileError(f"{self.name}: MLXKV001 ends inside {what} at byte {self.position}")
        self.position += n
        return data

    def skip(self, n: int, what: str) -> int:
        """Skip ``n`` bytes; returns where they start."""
        self.need(n, what)
        start = self.position
        self.position += n
        self.file.seek(self.position)
        return start

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")

    def i32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little", signed=True)

    def f32(self, what: str) -> float:
        return float(np.frombuffer(self.take(4, what), "<f4")[0])

    def string(self, what: str) -> str:
        n = self.u32(f"length of {what}")
        if n > MAX_STRING:
            raise LimitExceededError(f"{self.name}: MLXKV001 {what} of {n} bytes (limit {MAX_STRING})")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptFileError(f"{self.name}: MLXKV001 {what} is not UTF-8") from None

    def i32s(self, what: str) -> np.ndarray:
        n = self.u32(f"count of {what}")
        return np.frombuffer(self.take(4 * n, f"{n} int32 of {what}"), "<i4").astype(np.int64)


@dataclass(slots=True)
class _Tensor:
    """Where a tensor's payload lies and how to decode it (nothing read yet)."""

    tag: int
    count: int  # elements
    offset: int  # of the payload
    dtype: DType  # what it decodes to
    encoding: str  # "float32", "q8", or "native:<dtype>"
    scale: float = 1.0  # q8 only

    @property
    def nbytes(self) -> int:
        return self.count * (1 if self.tag == TAG_Q8 else self.dtype.itemsize)


def _tensor(stream: _Stream, what: str) -> _Tensor:
    tag = stream.u32(f"tag of {what}")
    count = stream.u32(f"element count of {what}")
    if tag == TAG_FLOAT32:
        offset = stream.skip(4 * count, f"{what}: {count} float32")
        return _Tensor(tag, count, offset, dtypes.FLOAT32, "float32")
    if tag == TAG_Q8:
        scale = stream.f32(f"q8 scale of {what}")
        offset = stream.skip(count, f"{what}: {count} int8")
        return _Tensor(tag, count, offset, dtypes.FLOAT32, "q8", scale)
    if tag == TAG_NATIVE:
        name = stream.string(f"dtype of {what}")
        dtype = NATIVE_NAMES.get(name)
        if dtype is None:
            raise UnsupportedFeatureError(
                f"{stream.name}: MLXKV001 {what} has dtype {name!r}; known: {', '.join(NATIVE_NAMES)}"
            )
        length = stream.u32(f"byte length of {what}")
        if length != count * dtype.itemsize:
            raise CorruptFileError(
                f"{stream.name}: MLXKV001 {what}: {length} bytes for {count} {dtype.name} elements "
                f"(expected {count * dtype.itemsize})"
            )
        offset = stream.skip(length, f"{what}: {count} {dtype.name}")
        return _Tensor(tag, count, offset, dtype, f"native:{dtype.name}")
    raise UnsupportedFeatureError(f"{stream.name}: MLXKV001 {what} has unknown tensor tag {tag} (0, 1, 2)")


def _float32s(stream: _Stream, what: str) -> _Tensor:
    """A version 1-2 head tensor: ``u32 count`` then float32 values."""
    count = stream.u32(f"count of {what}")
    offset = stream.skip(4 * count, f"{what}: {count} float32")
    return _Tensor(TAG_FLOAT32, count, offset, dtypes.FLOAT32, "float32")


@dataclass
class _Layer:
    """One layer record of the source: per-head tensors or a whole-layer slab."""

    offset: int  # of the layer record: pass 2 parses it again from here
    index: int
    cache_index: int
    cache_mode: str
    max_size: int
    heads: list[tuple[_Tensor, _Tensor]]
    key_shape: list[int] = field(default_factory=list)
    value_shape: list[int] = field(default_factory=list)
    key_slab: _Tensor | None = None
    value_slab: _Tensor | None = None

    def tensors(self) -> list[_Tensor]:
        listed = [t for pair in self.heads for t in pair]
        return [t for t in (self.key_slab, self.value_slab, *listed) if t is not None and t.count]

    @property
    def uses_slab(self) -> bool:
        return bool(self.key_slab is not None and self.key_slab.count)


@dataclass
class _Source:
    """The parsed layout of an MLXKV001 file (payloads not read)."""

    version: int
    architecture: str
    num_layers: int
    num_kv_heads: int
    seq_len: int
    head_dim: int
    num_query_heads: int
    token_offset: int
    tokens: list[int]
    generated: list[int]
    plans: list[_Plan]
    logit_shape: list[int]
    logits: _Tensor | None


def _cache_mode(stream: _Stream, where: str) -> str:
    """A version 5+ layer's cache mode; its opaque payloads skipped (a turboquant cache, which
    holds nothing but those, is refused)."""
    cache_mode = stream.string(f"{where} cache_mode")
    payloads = stream.u32(f"{where} payload count")
    if payloads > MAX_PAYLOADS:
        raise LimitExceededError(f"{stream.name}: MLXKV001 {where} lists {payloads} payloads")
    for i in range(payloads):
        stream.skip(stream.u32(f"{where} payload {i} length"), f"{where} payload {i}")
    if cache_mode == "turboquant":
        raise UnsupportedFeatureError(
            f"{stream.name}: MLXKV001 {where} is a turboquant cache (opaque payloads); "
            "only plain K/V tensors can be imported"
        )
    return cache_mode


def _layer(stream: _Stream, version: int, number: int, head: _Source) -> _Layer:
    where = f"layer record {number}"
    offset = stream.position
    index = stream.i32(f"{where} layer_index")
    if not 0 <= index < head.num_layers:
        raise CorruptFileError(
            f"{stream.name}: MLXKV001 {where} names layer {index}; the file declares {head.num_layers}"
        )
    where = f"layer {index}"
    cache_index = stream.i32(f"{where} cache_index")
    head_count = stream.u32(f"{where} head_count")
    if head_count > MAX_HEADS:
        raise LimitExceededError(f"{stream.name}: MLXKV001 {where} declares {head_count} heads")
    if head_count not in (0, head.num_kv_heads):
        raise CorruptFileError(
            f"{stream.name}: MLXKV001 {where} declares {head_count} heads; go-mlx writes 0 (no K/V in "
            f"this snapshot) or num_kv_heads ({head.num_kv_heads})"
        )
    cache_mode = _cache_mode(stream, where) if version >= 5 else ""
    max_size = stream.u32(f"{where} max_size") if version >= 6 else 0
    layer = _Layer(offset, index, cache_index, cache_mode, max_size, [])
    if version >= 4:
        layer.key_shape = stream.i32s(f"{where} key_shape").tolist()
        layer.key_slab = _tensor(stream, f"{where} key slab")
        layer.value_shape = stream.i32s(f"{where} value_shape").tolist()
        layer.value_slab = _tensor(stream, f"{where} value slab")
    for h in range(head_count):
        if version >= 3:
            pair = (_tensor(stream, f"{where} head {h} key"), _tensor(stream, f"{where} head {h} value"))
        else:
            pair = (_float32s(stream, f"{where} head {h} key"), _float32s(stream, f"{where} head {h} value"))
        layer.heads.append(pair)
    return layer


def read_layout(stream: _Stream, keep_heads: bool = False) -> _Source:
    """Parse everything but tensor payloads (pass 1). ``keep_heads``: keep each layer's per-head
    tensor list in its plan (a block of a bundle, parsed from memory), else drop it (one layer's
    tensors at a time; pass 2 parses them again)."""
    source = _header(stream)
    _layer_records(stream, source, keep_heads)
    if source.version >= 2:
        source.logit_shape = stream.i32s("logit_shape").tolist()
        count = stream.u32("count of logits")
        offset = stream.skip(4 * count, f"{count} float32 logits")
        source.logits = _Tensor(TAG_FLOAT32, count, offset, dtypes.FLOAT32, "float32") if count else None
    if stream.left():
        raise CorruptFileError(
            f"{stream.name}: MLXKV001 has {stream.left()} bytes after its last field (byte {stream.position})"
        )
    return source


def _header(stream: _Stream) -> _Source:
    """The fields before the layer records: magic, version, architecture, sizes, tokens."""
    magic = stream.take(len(MAGIC), "magic") if stream.size >= len(MAGIC) else b""
    if magic != MAGIC:
        raise CorruptFileError(f"{stream.name}: not an MLXKV001 file (magic {magic[:8]!r})")
    version = stream.u32("version")
    if version not in VERSIONS:
        raise UnsupportedVersionError(
            f"{stream.name}: MLXKV001 layout version {version}; this importer reads versions 1 to 6"
        )
    architecture = stream.string("architecture")
    num_layers, num_kv_heads = stream.u32("num_layers"), stream.u32("num_kv_heads")
    seq_len, head_dim = stream.u32("seq_len"), stream.u32("head_dim")
    num_query_heads = stream.u32("num_query_heads")
    if num_layers > MAX_LAYERS or num_kv_heads > MAX_HEADS or head_dim > MAX_WIDTH:
        raise LimitExceededError(
            f"{stream.name}: MLXKV001 declares {num_layers} layers, {num_kv_heads} KV heads, head_dim "
            f"{head_dim} (limits {MAX_LAYERS}, {MAX_HEADS}, {MAX_WIDTH})"
        )
    if head_dim == 0:
        raise CorruptFileError(f"{stream.name}: MLXKV001 head_dim is 0")
    token_offset = stream.u32("token_offset") if version >= 2 else 0
    tokens = stream.i32s("tokens").tolist()
    generated = stream.i32s("generated").tolist() if version >= 2 else []
    return _Source(
        version, architecture, num_layers, num_kv_heads, seq_len, head_dim, num_query_heads,
        token_offset, tokens, generated, [], [], None,
    )  # fmt: skip


def _layer_records(stream: _Stream, source: _Source, keep_heads: bool) -> None:
    """The layer records, each planned (`_plan`) into ``source.plans``: no layer twice, no more
    records than layers, one batch size."""
    layer_count = stream.u32("layer_count")
    if layer_count > source.num_layers:
        raise CorruptFileError(
            f"{stream.name}: MLXKV001 lists {layer_count} layer records for {source.num_layers} layers"
        )
    seen: set[int] = set()
    for number in range(layer_count):
        layer = _layer(stream, source.version, number, source)
        if layer.index in seen:
            raise CorruptFileError(f"{stream.name}: MLXKV001 lists layer {layer.index} twice")
        seen.add(layer.index)
        plan = _plan(stream.name, source, layer)
        if not keep_heads:
            layer.heads = []
        if plan is not None:
            source.plans.append(plan)
    batch = {p.seqs for p in source.plans}
    if len(batch) > 1:
        raise CorruptFileError(f"{stream.name}: MLXKV001 layers hold different batch sizes {sorted(batch)}")


@dataclass
class _Plan:
    """How one source layer becomes a `.kv` layer."""

    layer: _Layer
    spec: LayerSpec
    seqs: int
    # per (seq, head): K and V arrays come from a slab slice or a head tensor
    form: str  # "slab-bhld", "slab-lhd" or "heads"


def _slab_geometry(name: str, layer: _Layer) -> tuple[str, int, int, int, int, int]:
    """(form, B, H, L, Dk, Dv) of a slab layer, checked against the element counts."""
    assert layer.key_slab is not None and layer.value_slab is not None
    k_shape, v_shape = layer.key_shape, layer.value_shape
    where = f"{name}: MLXKV001 layer {layer.index}"
    if len(k_shape) != len(v_shape) or len(k_shape) not in (3, 4) or min(k_shape + v_shape) < 0:
        raise CorruptFileError(f"{where}: slab shapes {k_shape} / {v_shape} are not [B,H,L,D] or [L,H,D]")
    for shape, slab, what in ((k_shape, layer.key_slab, "key"), (v_shape, layer.value_slab, "value")):
        if int(np.prod(shape, dtype=np.int64)) != slab.count:
            raise CorruptFileError(
                f"{where}: {what} slab holds {slab.count} elements, shape {shape} says otherwise"
            )
    if len(k_shape) == 4:
        b, h, length, dk = k_shape
        if v_shape[:3] != [b, h, length]:
            raise CorruptFileError(f"{where}: key slab {k_shape} and value slab {v_shape} disagree")
        return "slab-bhld", b, h, length, dk, v_shape[3]
    length, h, dk = k_shape
    if v_shape[:2] != [length, h]:
        raise CorruptFileError(f"{where}: key slab {k_shape} and value slab {v_shape} disagree")
    return "slab-lhd", 1, h, length, dk, v_shape[2]


def _plan(name: str, source: _Source, layer: _Layer) -> _Plan | None:
    """Check one parsed layer record and say how it becomes a `.kv` layer (None: no K/V)."""
    where = f"{name}: MLXKV001 layer {layer.index}"
    tensors = layer.tensors()
    kinds = {t.dtype.name for t in tensors}
    dtype = dtypes.from_name(kinds.pop()) if len(kinds) == 1 else dtypes.FLOAT32
    attributes: dict[str, Any] = {
        "cache_index": layer.cache_index,
        "source_encoding": sorted({t.encoding for t in tensors}),
    }
    if layer.cache_mode:
        attributes["cache_mode"] = layer.cache_mode
    if layer.uses_slab:
        form, seqs, heads, rows, k_dim, v_dim = _slab_form(name, where, layer, attributes)
    else:
        form, seqs, heads, k_dim, v_dim = "heads", 1, len(layer.heads), source.head_dim, source.head_dim
        rows = _head_rows(where, source, layer)
    if heads == 0:
        return None  # a layer record without K/V: the layer stays absent
    _check_geometry(where, source, heads, rows, k_dim, v_dim)
    attributes.update(_window(layer, rows, source.seq_len))
    return _Plan(layer, LayerSpec(heads, k_dim, v_dim, dtype, attributes), seqs, form)


def _window(layer: _Layer, rows: list[int], seq_len: int) -> dict[str, Any]:
    """A layer's ``kind`` (sliding where it has a window or holds fewer rows than the sequence)
    and its ``window``."""
    sliding = layer.max_size > 0 or any(r < seq_len for r in rows)
    return {
        "kind": "sliding" if sliding else "full",
        **({"window": layer.max_size} if layer.max_size else {}),
    }


def _slab_form(
    name: str, where: str, layer: _Layer, attributes: dict[str, Any]
) -> tuple[str, int, int, list[int], int, int]:
    """A slab layer's form, batch size, heads, rows, K and V dims (`_slab_geometry`); that its
    per-head tensors are ignored is noted in ``attributes``."""
    form, seqs, heads, length, k_dim, v_dim = _slab_geometry(name, layer)
    if any(t.count for pair in layer.heads for t in pair):
        attributes["per_head_tensors_ignored"] = True  # the slab holds the layer
    if not 1 <= seqs <= MAX_SEQS:
        raise CorruptFileError(f"{where}: slab batch size {seqs} out of range 1..{MAX_SEQS}")
    return form, seqs, heads, [length], k_dim, v_dim


def _head_rows(where: str, source: _Source, layer: _Layer) -> list[int]:
    """Tokens per head of a layer stored head by head: each head's K and V whole rows of
    ``head_dim``, equally many."""
    rows = []
    for h, (k, v) in enumerate(layer.heads):
        if k.count % source.head_dim or v.count % source.head_dim:
            raise CorruptFileError(
                f"{where} head {h}: {k.count} key / {v.count} value elements are not rows of "
                f"head_dim {source.head_dim}"
            )
        if k.count != v.count:
            raise CorruptFileError(
                f"{where} head {h}: key holds {k.count // source.head_dim} tokens, "
                f"value {v.count // source.head_dim}"
            )
        rows.append(k.count // source.head_dim)
    return rows


def _check_geometry(where: str, source: _Source, heads: int, rows: list[int], k_dim: int, v_dim: int) -> None:
    """A layer's head count, tokens per head and head dims within the `.kv` limits and the
    snapshot's ``seq_len``."""
    if heads > MAX_HEADS:
        raise LimitExceededError(f"{where}: {heads} heads (limit {MAX_HEADS})")
    if max(rows, default=0) > source.seq_len:
        raise CorruptFileError(f"{where}: holds {max(rows)} tokens, more than seq_len {source.seq_len}")
    if not (1 <= k_dim <= MAX_WIDTH and 1 <= v_dim <= MAX_WIDTH):
        raise CorruptFileError(f"{where}: head dims {k_dim} / {v_dim} out of range 1..{MAX_WIDTH}")


def _decode(file: BinaryIO, tensor: _Tensor) -> np.ndarray:
    """A tensor's payload as a flat array of its `.kv` dtype."""
    file.seek(tensor.offset)
    raw = file.read(tensor.nbytes)
    if len(raw) != tensor.nbytes:
        raise TruncatedFileError(f"MLXKV001 tensor at byte {tensor.offset} ends early (the file shrank)")
    if tensor.tag == TAG_Q8:
        return np.frombuffer(raw, np.int8).astype(np.float32) * np.float32(tensor.scale)
    return np.frombuffer(raw, tensor.dtype.numpy)


def sha256_of(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ImportReport:
    """What `import_mlxkv` wrote: the output path, the source's layout version, layers, tokens."""

    path: str
    version: int
    layers: int
    seq_len: int
    sha256: str


def _file_metadata(source: _Source, name: str, size: int) -> dict[str, Any]:
    """The `.kv` file's metadata of the go-mlx snapshot ``name`` (``size`` bytes): its model and
    where it came from."""
    return {
        "model": {
            "architecture": source.architecture,
            "num_layers": source.num_layers,
            "num_attention_heads": source.num_query_heads,
            "num_kv_heads": source.num_kv_heads,
        },
        "source": {
            "format": "go-mlx MLXKV001",
            "version": source.version,
            "file": os.path.basename(name),
            "bytes": size,
            "seq_len": source.seq_len,
            "token_offset": source.token_offset,
        },
    }


def _write_snapshot(writer: Writer, file: BinaryIO, source: _Source, name: str, seqs: int) -> None:
    """The one snapshot: its token counts, the tokens of a single sequence, the last logits
    where the source holds them."""
    snapshot_metadata: dict[str, Any] = {"generated": len(source.generated)}
    if seqs == 1:
        snapshot_metadata["tokens"] = [source.tokens]
        snapshot_metadata["generated_ids"] = [source.generated]
    arrays = {}
    if source.logits is not None:
        arrays["last_logits"] = _last_logits(file, source, name)
        snapshot_metadata["last_logits_shape"] = source.logit_shape
    writer.snapshot(snapshot_metadata, arrays=arrays)


def import_mlxkv(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    codec: str | Codec = "raw",
    overwrite: bool = False,
) -> ImportReport:
    """Convert the go-mlx MLXKV001 snapshot ``src`` into the `.kv` file ``dst``.

    Memory is bounded by one layer of the source. A malformed ``src`` raises a
    `kvformat.KVFormatError` subclass naming the problem and leaves nothing at ``dst``.
    """
    name = os.fspath(src)
    out = check_output(dst, inputs=[name], force=overwrite)
    size = os.path.getsize(name)
    with open(name, "rb") as file:
        stream = _Stream(file, size, name)
        source = read_layout(stream)
        plans = source.plans
        by_index = {p.layer.index: p for p in plans}
        specs: list[LayerSpec | None] = [
            by_index[i].spec if i in by_index else None for i in range(source.num_layers)
        ]
        seqs = plans[0].seqs if plans else 1
        metadata = _file_metadata(source, name, size)
        writer = Writer(out, specs, num_seqs=seqs, metadata=metadata, codec=codec, overwrite=overwrite)
        try:
            for plan in plans:
                stream.position = plan.layer.offset
                file.seek(plan.layer.offset)
                layer = _layer(stream, source.version, 0, source)  # the same bytes as in pass 1
                _write_layer(writer, file, plan, layer, source.seq_len)
            _write_snapshot(writer, file, source, name, seqs)
            digest = sha256_of(name)
            writer.close({"source": {**metadata["source"], "sha256": digest}})
        except BaseException:
            writer.abort()
            with contextlib.suppress(FileNotFoundError):  # close() failed at the rename
                os.unlink(writer.partial_path)
            raise
    return ImportReport(out, source.version, len(plans), source.seq_len, digest)


def _last_logits(file: BinaryIO, source: _Source, name: str) -> np.ndarray:
    """The snapshot's last logits as float32 ``(rows, vocab)``, checked against ``logit_shape``."""
    assert source.logits is not None
    logits = _decode(file, source.logits).astype(np.float32)
    shape = source.logit_shape
    if int(np.prod(shape, dtype=np.int64)) != logits.size or not shape:
        raise CorruptFileError(f"{name}: MLXKV001 logit_shape {shape} does not hold {logits.size} logits")
    return logits.reshape(-1, shape[-1]) if shape[-1] else logits.reshape(1, -1)


def _write_layer(writer: Writer, file: BinaryIO, plan: _Plan, layer: _Layer, seq_len: int) -> None:
    """Read one source layer and append it (one layer in memory)."""
    spec = plan.spec
    assert spec.dtype is not None
    target = spec.dtype.numpy
    if plan.form == "heads":
        for h, (k_tensor, v_tensor) in enumerate(layer.heads):
            rows = k_tensor.count // spec.k_dim
            if rows == 0:
                continue
            head_k = _decode(file, k_tensor).astype(target, copy=False).reshape(rows, spec.k_dim)
            head_v = _decode(file, v_tensor).astype(target, copy=False).reshape(rows, spec.v_dim)
            writer.append_head(layer.index, h, head_k, head_v, np.arange(seq_len - rows, seq_len))
        return
    assert layer.key_slab is not None and layer.value_slab is not None
    k_flat = _decode(file, layer.key_slab).astype(target, copy=False)
    v_flat = _decode(file, layer.value_slab).astype(target, copy=False)
    heads = spec.num_heads
    if plan.form == "slab-bhld":
        k = k_flat.reshape(plan.seqs, heads, -1, spec.k_dim)
        v = v_flat.reshape(plan.seqs, heads, -1, spec.v_dim)
    else:  # [L, H, D]: token-major; a (heads, tokens, dim) view of it
        k = k_flat.reshape(1, -1, heads, spec.k_dim).transpose(0, 2, 1, 3)
        v = v_flat.reshape(1, -1, heads, spec.v_dim).transpose(0, 2, 1, 3)
    rows = int(k.shape[2])
    if rows == 0:
        return
    for seq in range(plan.seqs):
        writer.append(layer.index, k[seq], v[seq], np.arange(seq_len - rows, seq_len), seq=seq)


class MlxkvImporter(Importer):
    """go-mlx's MLXKV001 snapshot (layout versions 1 to 6): one `.kv` snapshot."""

    name = "mlxkv"
    description = "go-mlx MLXKV001 snapshot"
    magics = (MAGIC,)

    def convert(
        self,
        source: str | os.PathLike[str],
        output: str | os.PathLike[str],
        *,
        codec: str | Codec = "raw",
        overwrite: bool = False,
        **options: Any,
    ) -> Imported:
        given = sorted(name for name, value in options.items() if value not in (None, False))
        if given:
            raise InvalidArgumentError(
                f"{os.fspath(source)}: {', '.join(given)} applies to a State log, container or manifest"
            )
        report = import_mlxkv(source, output, codec=codec, overwrite=overwrite)
        return Imported(
            report.path,
            f"MLXKV001 version {report.version}, {report.layers} layer(s) with K/V, "
            f"seq_len {report.seq_len}, source sha256 {report.sha256[:16]}...",
        )

    def listing(self, source: str | os.PathLike[str]) -> list[str]:
        raise InvalidArgumentError(
            f"{os.fspath(source)}: a single MLXKV001 snapshot holds no bundles to list"
        )


IMPORTER = MlxkvImporter()
