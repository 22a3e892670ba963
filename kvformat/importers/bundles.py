"""Import go-mlx block bundles into one `.kv` series (``../shared/formats/mlxkv001-bundles.md``).

go-mlx splits a long snapshot into blocks of at most 512 tokens, each a complete MLXKV001
snapshot, stores them as records of a State log, and lists them in a JSON **bundle manifest**
(itself a record of the same log). A log holds one bundle per turn or pause, and a bundle may
reuse its parent's blocks. This module turns every bundle of a log, in write order, into one
snapshot of a `.kv` series:

- a bundle whose first blocks equal the previous bundle's (same ``token_start``,
  ``token_count`` and SHA-256) keeps their chunks: its snapshot drops only what follows them and
  appends its new blocks, so a block reused across bundles is stored once;
- each block's positions are ``token_start + i``; a sliding-window layer takes rows only from the
  blocks that hold it (go-mlx writes it with ``head_count = 0`` elsewhere);
- every block is checked before any of its bytes is written: the record magic and ``chunk_id``
  at ``frame_offset``, the length, the SHA-256 against ``kv_hash``, base64 envelopes unwrapped and
  checked against the ref, the block's own token count; manifests by the rules of section 3
  (index order, contiguous ``token_start``, ``snapshot_hash``).

Memory: one block at a time (plus the record index and the manifests), whatever the log's size.
Snapshot metadata records ``tokens``, ``generated_ids``, ``generated`` (from the last block)
and under ``bundle`` the URI, ``snapshot_hash``, encodings, block boundaries and which blocks
were reused; ``last_logits`` is attached as for a single MLXKV001 file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat import dtypes
from kvformat.checksum import crc32c
from kvformat.codecs import Codec
from kvformat.errors import CorruptFileError, InvalidArgumentError, KVFormatError
from kvformat.importers.bundle_manifest import Block, Bundle, bundles_of, parse_bundle, unwrap
from kvformat.importers.contract import Imported, Importer
from kvformat.importers.mlxkv import TAG_Q8, _last_logits, _Plan, _Source, _Stream, _Tensor, read_layout
from kvformat.importers.statelog import BUNDLE_KIND, MAX_JSON, Log, Record, open_log, parse_json
from kvformat.io.outputs import check_output
from kvformat.manifest import LayerSpec
from kvformat.sniff import KVST, STATE_LOGS
from kvformat.writer import Writer


def parse_block(data: bytes | memoryview, block: Block, what: str) -> _Source:
    """The layout of a block's MLXKV001 bytes (every layer's tensors kept: offsets, no data),
    checked against its ref."""
    source = read_layout(_BufferStream(data, what), keep_heads=True)
    if source.seq_len != block.token_count or (source.tokens and len(source.tokens) != block.token_count):
        raise CorruptFileError(
            f"{what}: the block holds seq_len {source.seq_len} and {len(source.tokens)} tokens; its ref "
            f"says {block.token_count}"
        )
    return source


@dataclass(frozen=True)
class BundleReport:
    """What `import_bundles` wrote: output path, source kind, bundles (snapshots), blocks
    referenced, blocks stored (each distinct block once), tokens of the last bundle."""

    path: str
    kind: str
    bundles: int
    blocks: int
    stored_blocks: int
    tokens: int


def list_bundles(src: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """One row per bundle of a log, container or manifest: URI, chunk, tokens, blocks, reused
    blocks (as the manifest counts them, and blocks shared with an earlier bundle)."""
    with _opened(src) as (_, bundles):
        rows: list[dict[str, Any]] = []
        seen: set[tuple[int, int | None]] = set()
        for b in bundles:
            shared = sum(block.place in seen for block in b.blocks)
            seen.update(block.place for block in b.blocks)
            rows.append(
                {
                    "uri": b.uri,
                    "chunk_id": b.record.chunk_id,
                    "tokens": b.token_count,
                    "blocks": len(b.blocks),
                    "reused_blocks": int(b.manifest.get("reused_blocks", 0)),
                    "shared_with_earlier": shared,
                    "kv_encoding": b.manifest.get("kv_encoding", ""),
                }
            )
        return rows


@contextlib.contextmanager
def _opened(src: str | os.PathLike[str], bundle: str | None = None) -> Iterator[tuple[Log, list[Bundle]]]:
    """The log of ``src`` (a log, a container or a manifest JSON beside its log) and the bundles
    to import (all, in write order, or the last one with URI ``bundle``)."""
    name = os.fspath(src)
    manifest: tuple[str, bytes] | None = None
    with open(name, "rb") as probe:
        if _is_manifest(probe.read(1)):
            manifest = (name, _manifest_bytes(name))
            name = _log_beside(name, parse_json(manifest[1], name))
    with open(name, "rb") as file:
        log = open_log(file, name)
        bundles = bundles_of(log) if manifest is None else [_manifest_file(*manifest)]
        if bundle is not None:
            chosen = [b for b in bundles if b.uri == bundle]
            if not chosen:
                known = ", ".join(sorted({b.uri for b in bundles})) or "none"
                raise KVFormatError(f"{name}: no bundle with URI {bundle!r} (bundles: {known})")
            bundles = chosen[-1:]
        if not bundles:
            raise CorruptFileError(f"{name}: the log holds no bundle manifest (kind {BUNDLE_KIND})")
        yield log, bundles


def _is_manifest(prefix: bytes) -> bool:
    """Whether a file beginning with ``prefix`` is a bundle manifest kept as JSON (not a log)."""
    return prefix[:1] == b"{"


def _manifest_bytes(path: str) -> bytes:
    """A bundle manifest kept as a JSON file (at most `MAX_JSON` bytes)."""
    size = os.path.getsize(path)
    if size > MAX_JSON:
        raise CorruptFileError(f"{path}: a {size}-byte manifest (limit {MAX_JSON})")
    with open(path, "rb") as f:
        return f.read()


def _manifest_file(path: str, data: bytes) -> Bundle:
    """A manifest file's bundle, checked like a record's (the file is its one record)."""
    record = Record(0, -1, 0, len(data), {"uri": os.path.basename(path), "kind": BUNDLE_KIND})
    return parse_bundle(Log(path, io.BytesIO(data), len(data), 0, len(data), b""), record)


def _segments(manifest: dict[str, Any]) -> set[str]:
    """The log paths (``segment``) a manifest's block refs name."""
    refs = [
        ref
        for raw in manifest.get("blocks", [])
        if isinstance(raw, dict)
        for ref in (raw.get("state"), raw.get("memvid"))
    ]
    return {str(ref["segment"]) for ref in refs if isinstance(ref, dict) and ref.get("segment")}


def _log_beside(manifest_path: str, manifest: dict[str, Any]) -> str:
    """The log a manifest JSON file's refs name (their ``segment``), found at that path or beside
    the manifest; else the only ``*.mvlog`` beside it."""
    folder = os.path.dirname(os.path.abspath(manifest_path))
    segments = _segments(manifest)
    for segment in sorted(segments):
        for candidate in (segment, os.path.join(folder, os.path.basename(segment))):
            if os.path.isfile(candidate):
                return candidate
    logs = sorted(n for n in os.listdir(folder) if n.endswith(".mvlog"))
    if len(logs) == 1:
        return os.path.join(folder, logs[0])
    named = ", ".join(sorted(segments)) or "no segment"
    raise KVFormatError(
        f"{manifest_path}: cannot find the State log its blocks live in ({named}; "
        f"{len(logs)} *.mvlog files beside it); pass the log or the container itself"
    )


@dataclass
class _BlockInfo:
    """What pass 1 keeps of a block: its CRC-32C (pass 2 must read the same bytes), token ids,
    header fields, and each plan with its tensors (offsets into the block, no data)."""

    crc: int
    tokens: list[int]
    generated: list[int]
    token_offset: int
    source: _Source


class _Import:
    """The state of one import: the log, the bundles, what each block held."""

    def __init__(self, log: Log, bundles: list[Bundle]) -> None:
        self.log, self.bundles = log, bundles
        self.places: set[tuple[int, int | None]] = set()
        self.info: dict[tuple[int, int, str, int], _BlockInfo] = {}
        self.hashing = ThreadPoolExecutor(1, thread_name_prefix="kvsnap-sha256")
        self.buffer = bytearray()  # one block, reused

    def _what(self, bundle: Bundle, block: Block) -> str:
        return f"{self.log.name}: bundle {bundle.uri or '(no uri)'} block {block.index}"

    def locate(self, bundle: Bundle, block: Block) -> Record:
        """The record a block's ref points at (magic, chunk id and, for raw payloads, length
        checked)."""
        what = self._what(bundle, block)
        if block.frame_offset is not None:
            record = self.log.record_at(block.frame_offset, block.chunk_id, what)
        else:
            record = self.log.record_of(block.chunk_id, what)
        if block.payload_encoding == "raw" and block.byte_count and record.size != block.byte_count:
            raise CorruptFileError(
                f"{what}: {record.size} payload bytes, the manifest says {block.byte_count}"
            )
        return record

    def data(self, bundle: Bundle, block: Block) -> bytes | memoryview:
        """A block's MLXKV001 bytes: a raw payload as stored, in the reused buffer (its SHA-256
        is checked by the caller), or an envelope unwrapped and checked."""
        record = self.locate(bundle, block)
        what = self._what(bundle, block)
        if block.payload_encoding == "json-base64":
            return unwrap(self.log, record, block, what)
        if len(self.buffer) < record.size:
            self.buffer = bytearray(record.size)  # a new one: views of the old may still be held
        return self.log.read_into(record.start, record.size, self.buffer, what)

    @staticmethod
    def key(block: Block) -> tuple[int, int, str, int]:
        """Blocks with the same key are the same block (by hash; by chunk when unhashed)."""
        return (*block.identity, 0 if block.kv_hash else block.chunk_id)

    def plan(self) -> tuple[list[LayerSpec | None], int, _Source]:
        """Pass 1: every distinct block's layout, merged into one layer spec per layer; the first
        block's header for the model fields. Every ref is resolved, even to a block seen before."""
        specs: dict[int, LayerSpec] = {}
        first: _Source | None = None
        seqs: set[int] = set()
        for bundle in self.bundles:
            for block in bundle.blocks:
                if self.key(block) in self.info:
                    self.locate(bundle, block)
                    continue
                data = self.data(bundle, block)
                source = parse_block(data, block, self._what(bundle, block))
                self.info[self.key(block)] = _BlockInfo(
                    crc32c(data), list(source.tokens), list(source.generated), source.token_offset, source
                )
                first = first or source
                if (source.num_layers, source.num_kv_heads, source.head_dim) != (
                    first.num_layers,
                    first.num_kv_heads,
                    first.head_dim,
                ):
                    raise CorruptFileError(
                        f"{self._what(bundle, block)}: its model header differs from the first block's"
                    )
                for plan in source.plans:
                    seqs.add(plan.seqs)
                    specs[plan.layer.index] = _merge(specs.get(plan.layer.index), plan, self.log.name)
        assert first is not None
        if len(seqs) > 1:
            raise CorruptFileError(f"{self.log.name}: blocks hold different batch sizes {sorted(seqs)}")
        return [specs.get(i) for i in range(first.num_layers)], (seqs.pop() if seqs else 1), first

    def checked(self, bundle: Bundle, block: Block) -> tuple[bytes | memoryview, Future[None]]:
        """Pass 2: a block's bytes, the same as pass 1 parsed (CRC-32C), and the check of their
        SHA-256 against ``kv_hash``, running on a thread while the block is written."""
        data = self.data(bundle, block)
        what = self._what(bundle, block)
        if crc32c(data) != self.info[self.key(block)].crc:
            raise CorruptFileError(f"{what} changed while it was being imported")
        return data, self.hashing.submit(_check_hash, data, block, what)

    def write(self, writer: Writer, seqs: int) -> int:
        """Pass 2: one snapshot per bundle; returns the blocks stored. No snapshot is committed
        before the SHA-256 of every block it holds has been checked."""
        previous: list[Block] = []
        stored = 0
        for bundle in self.bundles:
            keep = _kept(previous, bundle.blocks)
            start = bundle.blocks[keep].token_start if keep < len(bundle.blocks) else bundle.token_count
            end = previous[-1].token_start + previous[-1].token_count if previous else 0
            if end > start:
                _drop_all(writer, seqs, start, end)
            last: bytes | memoryview = b""
            for block in bundle.blocks[keep:]:
                last, check = self.checked(bundle, block)
                _append_block(writer, last, self.info[self.key(block)].source, block.token_start)
                check.result()  # hashed while it was appended; one block in memory
                stored += 1
            if not last:  # every block kept: the last one is read again for its logits
                last, check = self.checked(bundle, bundle.blocks[-1])
                check.result()
            writer.snapshot(*self._snapshot_metadata(bundle, keep, last, seqs))
            self.places.update(b.place for b in bundle.blocks)
            previous = bundle.blocks
        return stored

    def _described(self, bundle: Bundle, kept: int) -> dict[str, Any]:
        """Snapshot metadata ``bundle``: where the snapshot came from."""
        keys = ("snapshot_hash", "kv_encoding", "token_count", "token_offset", "block_size", "reused_blocks")
        return {
            "uri": bundle.uri,
            "chunk_id": bundle.record.chunk_id,
            **{k: bundle.manifest[k] for k in keys if k in bundle.manifest},
            "blocks": [[b.token_start, b.token_count] for b in bundle.blocks],
            "block_hashes": [b.kv_hash for b in bundle.blocks],
            "kept_from_previous_snapshot": kept,
            "blocks_seen_before": [b.index for b in bundle.blocks if b.place in self.places],
        }

    def _snapshot_metadata(
        self, bundle: Bundle, kept: int, data: bytes | memoryview, seqs: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        info = self.info[self.key(bundle.blocks[-1])]
        tokens = [t for block in bundle.blocks for t in self.info[self.key(block)].tokens]
        manifest = bundle.manifest
        stated = manifest.get("token_offset", 0)
        if stated and info.token_offset != stated:
            raise CorruptFileError(
                f"{self.log.name}: bundle {bundle.uri}: its last block's token_offset {info.token_offset} "
                f"differs from the manifest's {stated}"
            )
        metadata: dict[str, Any] = {"generated": len(info.generated), "bundle": self._described(bundle, kept)}
        if seqs == 1:
            metadata["tokens"] = [tokens]
            metadata["generated_ids"] = [info.generated]
        arrays: dict[str, Any] = {}
        if info.source.logits is not None:
            arrays["last_logits"] = _last_logits(_MemoryFile(data), info.source, self.log.name)  # type: ignore[arg-type]
            metadata["last_logits_shape"] = info.source.logit_shape
        return metadata, arrays


def _kept(previous: list[Block], blocks: list[Block]) -> int:
    """How many first blocks ``blocks`` shares with ``previous`` (same range, same SHA-256)."""
    keep = 0
    while (
        keep < min(len(previous), len(blocks))
        and blocks[keep].kv_hash
        and previous[keep].identity == blocks[keep].identity
    ):
        keep += 1
    return keep


def _drop_all(writer: Writer, seqs: int, start: int, end: int) -> None:
    """Drop positions ``[start, end)`` from every present layer and sequence."""
    for layer, spec in enumerate(writer.manifest.layers):
        for seq in range(seqs if spec.present else 0):
            writer.drop(layer, start, end, seq=seq)


class _BufferStream(_Stream):
    """`kvformat.importers.mlxkv`'s checked reads over bytes in memory: fields are sliced, payloads skipped
    by moving the position (no file calls)."""

    def __init__(self, data: bytes | memoryview, name: str) -> None:
        self.data = memoryview(data)
        self.size, self.name, self.position = len(self.data), name, 0

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        start = self.position
        self.position += n
        return self.data[start : self.position].tobytes()

    def skip(self, n: int, what: str) -> int:
        self.need(n, what)
        start = self.position
        self.position += n
        return start


class _MemoryFile:
    """``read``/``seek`` over bytes in memory without copying them (`io.BytesIO` copies a
    memoryview): what `kvformat.importers.mlxkv`'s parser needs of a file."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.data, self.position = memoryview(data), 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = (
            offset if whence == 0 else self.position + offset if whence == 1 else len(self.data) + offset
        )
        return self.position

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else min(len(self.data), self.position + n)
        out = bytes(self.data[self.position : end])
        self.position = max(self.position, end)
        return out


def _check_hash(data: bytes | memoryview, block: Block, what: str) -> None:
    if block.kv_hash and hashlib.sha256(data).hexdigest() != block.kv_hash:
        raise CorruptFileError(
            f"{what}: SHA-256 of its {len(data)} bytes does not match kv_hash {block.kv_hash}"
        )


def _tensor_view(data: bytes | memoryview, tensor: _Tensor, target: np.dtype[Any]) -> np.ndarray:
    """A tensor's values as a flat array of ``target``: a view of ``data`` when no conversion is
    needed."""
    if tensor.tag == TAG_Q8:
        raw = np.frombuffer(data, np.int8, tensor.count, tensor.offset)
        return raw.astype(np.float32) * np.float32(tensor.scale)
    values = np.frombuffer(data, tensor.dtype.numpy, tensor.count, tensor.offset)
    return values.astype(target, copy=False)


def _heads(data: bytes | memoryview, tensors: list[_Tensor], target: np.dtype[Any], dim: int) -> np.ndarray:
    """``(heads, rows, dim)`` of equally long head tensors: one strided view of ``data`` when they
    are equally spaced and need no conversion, else stacked."""
    rows = tensors[0].count // dim
    offsets = np.array([t.offset for t in tensors], np.int64)
    steps = np.diff(offsets)
    plain = all(t.tag != TAG_Q8 and t.dtype.numpy == target for t in tensors)
    if plain and len(tensors) > 1 and (steps == steps[0]).all() and steps[0] > 0:
        base = np.frombuffer(data, target, rows * dim, tensors[0].offset)
        return np.lib.stride_tricks.as_strided(
            base,
            (len(tensors), rows, dim),
            (int(steps[0]), dim * target.itemsize, target.itemsize),
            writeable=False,
        )
    return np.stack([_tensor_view(data, t, target).reshape(rows, dim) for t in tensors])


Append = tuple[int, Any, Any, Any, int]  # (layer, k, v, positions, seq) of `Writer.append_many`


def _append_block(writer: Writer, data: bytes | memoryview, source: _Source, start: int) -> None:
    """Append every layer of a block (positions from ``start``) in one `Writer.append_many`,
    written before it returns, from views of ``data`` where possible."""
    appends: list[Append] = []
    end = start + source.seq_len
    for plan in source.plans:
        appends += _head_appends(data, plan, end) if plan.form == "heads" else _slab_appends(data, plan, end)
    writer.append_many(appends)


def _head_appends(data: bytes | memoryview, plan: _Plan, end: int) -> list[Append]:
    """A layer stored head by head: ``(heads, rows, dim)`` K and V ending at position ``end``."""
    spec, layer = plan.spec, plan.layer
    assert spec.dtype is not None
    target = np.dtype(spec.dtype.numpy)
    if not layer.heads or not layer.heads[0][0].count:
        return []
    k = _heads(data, [pair[0] for pair in layer.heads], target, spec.k_dim)
    v = _heads(data, [pair[1] for pair in layer.heads], target, spec.v_dim)
    return [(layer.index, k, v, np.arange(end - k.shape[1], end), 0)]


def _slab_appends(data: bytes | memoryview, plan: _Plan, end: int) -> list[Append]:
    """A layer stored as one slab, ``[B, H, L, D]`` or ``[L, H, D]``: one append per sequence."""
    spec, layer = plan.spec, plan.layer
    assert spec.dtype is not None and layer.key_slab is not None and layer.value_slab is not None
    target = np.dtype(spec.dtype.numpy)
    k_flat, v_flat = _tensor_view(data, layer.key_slab, target), _tensor_view(data, layer.value_slab, target)
    if plan.form == "slab-bhld":
        k = k_flat.reshape(plan.seqs, spec.num_heads, -1, spec.k_dim)
        v = v_flat.reshape(plan.seqs, spec.num_heads, -1, spec.v_dim)
    else:  # [L, H, D]: token-major
        k = k_flat.reshape(1, -1, spec.num_heads, spec.k_dim).transpose(0, 2, 1, 3)
        v = v_flat.reshape(1, -1, spec.num_heads, spec.v_dim).transpose(0, 2, 1, 3)
    rows = int(k.shape[2])
    return [
        (layer.index, k[seq], v[seq], np.arange(end - rows, end), seq)
        for seq in range(plan.seqs if rows else 0)
    ]


def _merge(spec: LayerSpec | None, plan: _Plan, name: str) -> LayerSpec:
    """One layer's spec over every block that holds it: equal geometry; dtypes that differ
    widen to float32; the source encodings and the sliding window united."""
    new = plan.spec
    if spec is None:
        return new
    if (spec.num_heads, spec.k_dim, spec.v_dim) != (new.num_heads, new.k_dim, new.v_dim):
        raise CorruptFileError(
            f"{name}: layer {plan.layer.index} holds {spec.num_heads} heads of {spec.k_dim}/{spec.v_dim} "
            f"in one block and {new.num_heads} of {new.k_dim}/{new.v_dim} in another"
        )
    attributes = dict(spec.attributes)
    attributes["source_encoding"] = sorted(
        set(spec.attributes["source_encoding"]) | set(new.attributes["source_encoding"])
    )
    if new.attributes.get("kind") == "sliding":
        attributes["kind"] = "sliding"
        if "window" in new.attributes:
            attributes["window"] = new.attributes["window"]
    dtype = spec.dtype if spec.dtype == new.dtype else dtypes.FLOAT32
    return LayerSpec(spec.num_heads, spec.k_dim, spec.v_dim, dtype, attributes)


def import_bundles(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    bundle: str | None = None,
    codec: str | Codec = "raw",
    overwrite: bool = False,
) -> BundleReport:
    """Import the bundles of a go-mlx State log, ``KVST`` container, or bundle manifest JSON
    ``src`` into the `.kv` series ``dst``: one snapshot per bundle in write order (``bundle``: only
    the last one with that URI). A malformed source raises a `kvformat.KVFormatError` subclass
    naming the problem and leaves nothing at ``dst``."""
    out = check_output(dst, inputs=[os.fspath(src)], force=overwrite)
    with _opened(src, bundle) as (log, bundles):
        job = _Import(log, bundles)
        specs, seqs, first = job.plan()
        metadata = {
            "model": {
                "architecture": first.architecture,
                "num_layers": first.num_layers,
                "num_attention_heads": first.num_query_heads,
                "num_kv_heads": first.num_kv_heads,
            },
            "source": _provenance(log, bundles, first),
        }
        writer = Writer(out, specs, num_seqs=seqs, metadata=metadata, codec=codec, overwrite=overwrite)
        try:
            stored = job.write(writer, seqs)
            writer.close()
        except BaseException:
            job.hashing.shutdown(cancel_futures=True)
            writer.abort()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(writer.partial_path)
            raise
        job.hashing.shutdown()
    total = sum(len(b.blocks) for b in bundles)
    return BundleReport(out, log.kind, len(bundles), total, stored, bundles[-1].token_count)


def _provenance(log: Log, bundles: list[Bundle], first: _Source) -> dict[str, Any]:
    source: dict[str, Any] = {
        "format": log.kind,
        "file": os.path.basename(log.name),
        "bytes": log.size,
        "log_magic": log.magic.decode().strip(),
        "block_version": first.version,
        "bundles": [b.uri for b in bundles],
    }
    if log.container is not None:
        source["container"] = json.loads(json.dumps(log.container))
        source["container_version"] = log.container_version
    return source


class BundlesImporter(Importer):
    """go-mlx's State logs, ``KVST`` containers and bundle manifests: a series, one snapshot per
    bundle (option ``bundle``: only the last one with that URI)."""

    name = "go-mlx-bundles"
    description = "go-mlx State log, KVST container or bundle manifest (JSON)"
    magics = (KVST, *STATE_LOGS)

    def recognises(self, prefix: bytes) -> bool:
        return super().recognises(prefix) or _is_manifest(prefix)  # a manifest beside its log

    def what(self, prefix: bytes) -> str:
        return "go-mlx KVST container" if prefix.startswith(KVST) else "go-mlx State log"

    def convert(
        self,
        source: str | os.PathLike[str],
        output: str | os.PathLike[str],
        *,
        codec: str | Codec = "raw",
        overwrite: bool = False,
        **options: Any,
    ) -> Imported:
        bundle = options.pop("bundle", None)
        if any(value not in (None, False) for value in options.values()):
            raise InvalidArgumentError(
                f"{os.fspath(source)}: options {sorted(options)} are not this format's"
            )
        done = import_bundles(source, output, bundle=bundle, codec=codec, overwrite=overwrite)
        return Imported(
            done.path,
            f"{done.bundles} bundle(s) of a {done.kind} as {done.bundles} snapshot(s); {done.blocks} "
            f"block ref(s), {done.stored_blocks} block(s) stored; last bundle {done.tokens} tokens",
        )

    def listing(self, source: str | os.PathLike[str]) -> list[str]:
        rows = list_bundles(source)
        lines = [f"{os.fspath(source)}: {len(rows)} bundle(s), in write order"]
        for row in rows:
            lines.append(
                f"  {row['uri'] or '(no uri)'}  chunk {row['chunk_id']}: {row['tokens']} tokens, "
                f"{row['blocks']} blocks ({row['reused_blocks']} reused per its manifest, "
                f"{row['shared_with_earlier']} shared with an earlier bundle), "
                f"{row['kv_encoding'] or 'encoding unstated'}"
            )
        return lines


IMPORTER = BundlesImporter()
