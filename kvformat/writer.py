"""Streaming writer: append K/V token ranges as they arrive, commit snapshots, index at the end.

The writer appends to ``PATH.partial``; ``close()`` writes the index and footer, fsyncs and
renames to ``PATH``. A crash leaves only the ``.partial`` file, which `kvformat.recover` turns into
a valid snapshot of every complete chunk. Memory use is the index (64 bytes per chunk), never the
data.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat import codecs, dtypes
from kvformat.checksum import crc32c
from kvformat.codecs import BytesLike, Codec
from kvformat.dtypes import DType
from kvformat.layout import (
    ALIGN,
    KIND_ARRAY,
    KIND_K,
    KIND_MANIFEST,
    KIND_SNAPSHOT,
    KIND_V,
    MAX_CHUNK_DECODED,
    MAX_POSITION,
    Descriptor,
    Footer,
    align,
    pack_header,
)
from kvformat.manifest import LayerSpec, Manifest, dumps
from kvformat.series import Entry, Key, Run, trim

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024
_ZEROS = bytes(ALIGN)
_OVERLAP_BYTES = 1 << 20  # payloads this large get their CRC computed beside the write


def _crc_of(pieces: list[BytesLike]) -> int:
    crc = 0
    for piece in pieces:
        crc = crc32c(piece, crc)
    return crc


def _as_positions(positions: Any, count: int) -> np.ndarray:
    array = positions if isinstance(positions, np.ndarray) else np.asarray(positions)
    if array.shape != (count,):
        raise ValueError(f"positions must have shape ({count},), got {array.shape}")
    if not count:
        return array.astype(np.int64, copy=False)
    if array.dtype.kind not in "iu":
        raise TypeError(f"positions must be integers, got {array.dtype}")
    array = array.astype(np.int64, copy=False)
    first, last = int(array[0]), int(array[-1])
    if first < 0 or last >= MAX_POSITION:
        raise ValueError(f"positions must lie in 0..2**53-1, got {first}..{last}")
    if count > 1 and not (array[1:] > array[:-1]).all():
        raise ValueError("positions must be strictly increasing")
    return array


def _byte_view(array: np.ndarray) -> memoryview:
    """A zero-copy byte view of a C-contiguous array (bfloat16 included)."""
    return array.reshape(-1).view(np.uint8).data


class Writer:
    """Write one `.kv` file incrementally.

    ``layers`` declares every layer up front (`LayerSpec`, or ``None`` for an absent layer).
    ``durable=False`` skips the fsyncs at close (the rename stays atomic, but a power loss may
    lose the file); for scratch files on tmpfs or benchmarks against non-syncing peers.
    ``append`` adds tokens to a layer, ``drop`` removes positions from the live state (a sliding
    window moving on), ``snapshot`` commits the live state of every layer as one snapshot.
    Chunks already written are shared by later snapshots, so a series costs only what is new.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layers: Sequence[LayerSpec | None],
        *,
        num_seqs: int = 1,
        metadata: dict[str, Any] | None = None,
        codec: str | Codec = "raw",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        required_features: Sequence[str] = (),
        optional_features: Sequence[str] = (),
        durable: bool = True,
    ) -> None:
        specs = [layer if layer is not None else LayerSpec.absent() for layer in layers]
        for spec in specs:
            spec.check()
        if not isinstance(num_seqs, int) or num_seqs < 1:
            raise ValueError(f"num_seqs must be a positive integer, got {num_seqs!r}")
        if not 1 <= chunk_bytes <= MAX_CHUNK_DECODED:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_DECODED}")
        self.path = os.fspath(path)
        self.partial_path = self.path + ".partial"
        self.durable = durable
        self.codec = codecs.parse(codec)
        self.chunk_bytes = chunk_bytes
        self.manifest = Manifest(
            layers=specs,
            num_seqs=num_seqs,
            metadata=dict(metadata or {}),
            required_features=list(required_features),
            optional_features=list(optional_features),
        )
        manifest_json = dumps(self.manifest.to_json())
        try:
            self._file = open(self.partial_path, "xb")  # noqa: SIM115 - closed in close()/abort()
        except FileExistsError:
            raise FileExistsError(
                f"{self.partial_path} exists: an earlier write did not finish. Run "
                f"'kvsnap recover {self.partial_path}' to keep its data, or delete it."
            ) from None
        self._offset = 0
        self._chunks: list[Descriptor] = []
        self._live: dict[Key, list[Run]] = {}
        self._pending: dict[Key, list[Run]] = {}
        self._pending_drops: list[tuple[int, int, int, int]] = []
        self._snapshots: list[Entry] = []
        self._dirty = False
        self._closed = False
        self._crc_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvformat-crc")
        self._scratch = np.empty(0, np.uint8)
        self.overlap_bytes = _OVERLAP_BYTES
        self._write(pack_header())
        self._write_json_record(KIND_MANIFEST, manifest_json)

    # -- low level -----------------------------------------------------------------------
    def _write(self, data: BytesLike) -> None:
        self._file.write(data)
        self._offset += memoryview(data).nbytes

    def _write_record(self, descriptor: Descriptor, pieces: list[BytesLike]) -> None:
        self._write(descriptor.pack())
        self._write_payload(pieces)

    def _write_payload(self, pieces: list[BytesLike]) -> None:
        """The payload pieces, then zero padding to the next multiple of 64."""
        for piece in pieces:
            self._write(piece)
        pad = align(self._offset) - self._offset
        if pad:
            self._write(_ZEROS[:pad])

    def _write_json_record(self, kind: int, payload: bytes) -> None:
        descriptor = Descriptor(
            kind=kind,
            dtype=0,
            codec=0,
            layer=0,
            head=0,
            seq=0,
            position=0,
            rows=0,
            width=0,
            offset=self._offset,
            stored_size=len(payload),
            decoded_size=len(payload),
            payload_crc=crc32c(payload),
        )
        self._write_record(descriptor, [payload])

    def _write_chunk(
        self,
        kind: int,
        dtype: DType,
        layer: int,
        head: int,
        seq: int,
        position: int,
        rows: np.ndarray,
        width: int | None = None,
    ) -> int:
        """Encode and write one table chunk (``rows``: C-contiguous 2-D, stored bytes; ``width``
        in elements, default ``rows.shape[1]``); return its index."""
        data = _byte_view(rows)
        pieces = self.codec.encode(data, dtype.itemsize)
        stored = sum(memoryview(piece).nbytes for piece in pieces)
        offset = self._offset
        if stored >= self.overlap_bytes:
            # Large payload: write a placeholder descriptor and the payload while another thread
            # computes the CRC, then put the real descriptor in place. A crash in between leaves
            # a zero descriptor, which recovery treats as the end of the complete records.
            pending = self._crc_pool.submit(_crc_of, pieces)
            self._write(_ZEROS)
            self._write_payload(pieces)
            crc = pending.result()
        else:
            crc = _crc_of(pieces)
        descriptor = Descriptor(
            kind=kind,
            dtype=dtype.code,
            codec=self.codec.code,
            layer=layer,
            head=head,
            seq=seq,
            position=position,
            rows=rows.shape[0],
            width=width or rows.shape[1],
            offset=offset,
            stored_size=stored,
            decoded_size=data.nbytes,
            payload_crc=crc,
        )
        if stored >= self.overlap_bytes:
            self._file.flush()
            os.pwrite(self._file.fileno(), descriptor.pack(), offset)
        else:
            self._write_record(descriptor, pieces)
        self._chunks.append(descriptor)
        return len(self._chunks) - 1

    def _write_array(self, name: str, value: Any) -> int:
        if not isinstance(name, str) or not name:
            raise ValueError("array names must be non-empty strings")
        array = np.ascontiguousarray(value)
        if array.ndim == 1:
            array = array.reshape(1, -1)
        if array.ndim != 2:
            raise ValueError(f"array {name!r} must be 1-D or 2-D, got shape {array.shape}")
        return self._write_chunk(KIND_ARRAY, dtypes.from_numpy(array.dtype), 0, 0, 0, 0, array)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"writer for {self.path} is closed")

    def _layer(self, layer: int) -> LayerSpec:
        if not isinstance(layer, int) or not 0 <= layer < len(self.manifest.layers):
            raise IndexError(f"layer {layer} out of range 0..{len(self.manifest.layers) - 1}")
        spec = self.manifest.layers[layer]
        if not spec.present:
            raise ValueError(f"layer {layer} is declared absent; it cannot hold K/V")
        return spec

    def _check_seq(self, seq: int) -> None:
        if not isinstance(seq, int) or not 0 <= seq < self.manifest.num_seqs:
            raise IndexError(f"seq {seq} out of range 0..{self.manifest.num_seqs - 1}")

    # -- public API ----------------------------------------------------------------------
    def next_position(self, layer: int, seq: int = 0) -> int:
        """One past the last position any head of ``layer`` holds for ``seq`` (0 if empty)."""
        ends = [
            runs[-1][3] + runs[-1][2]
            for (lay, sq, _head, _kind), runs in self._live.items()
            if lay == layer and sq == seq and runs
        ]
        return max(ends, default=0)

    def append(self, layer: int, k: Any, v: Any, positions: Any = None, *, seq: int = 0) -> None:
        """Append tokens to every head of ``layer`` for sequence ``seq``.

        ``k``: ``(num_heads, n_tokens, k_dim)``, ``v``: ``(num_heads, n_tokens, v_dim)``, in the
        layer's dtype; for a quantized layer each is a tuple ``(packed, scales, biases)`` of
        ``(num_heads, n_tokens, ...)`` arrays. ``positions``: ``(n_tokens,)`` strictly increasing
        absolute positions after what the layer holds; default: continue from `next_position`.
        """
        self._check_open()
        spec = self._layer(layer)
        self._check_seq(seq)
        if spec.quantization is not None:
            k_heads = [tuple(np.asarray(part)[h] for part in k) for h in range(spec.num_heads)]
            v_heads = [tuple(np.asarray(part)[h] for part in v) for h in range(spec.num_heads)]
            count = np.asarray(k[0]).shape[1]
        else:
            k_array, v_array = np.asarray(k), np.asarray(v)
            for name, array, dim in (("k", k_array, spec.k_dim), ("v", v_array, spec.v_dim)):
                expected = (spec.num_heads, k_array.shape[1] if k_array.ndim == 3 else -1, dim)
                if array.shape != expected:
                    raise ValueError(f"layer {layer} {name} must have shape {expected}, got {array.shape}")
            k_heads, v_heads, count = list(k_array), list(v_array), k_array.shape[1]
        if positions is None:
            positions = np.arange(count, dtype=np.int64) + self.next_position(layer, seq)
        pos = _as_positions(positions, count)  # checked once for every head
        for head in range(spec.num_heads):
            self._append_head(layer, head, k_heads[head], v_heads[head], pos, seq, checked=True)

    @staticmethod
    def _stored_rows(spec: LayerSpec, where: str, data: Any, dim: int) -> np.ndarray:
        """The rows exactly as stored before the codec: ``(n_tokens, ...)`` (C-contiguous for a
        quantized layer; possibly strided otherwise)."""
        assert spec.dtype is not None
        if spec.quantization is None:
            array = np.asarray(data)  # strided views are gathered chunk by chunk (`_gathered`)
            if array.ndim != 2 or array.shape[1] != dim:
                raise ValueError(f"{where} must have shape (n_tokens, {dim}), got {array.shape}")
            if array.dtype != spec.dtype.numpy:
                raise TypeError(f"{where} is {array.dtype} but the layer is {spec.dtype.name}; convert first")
            return array
        words, groups = spec.quantization.widths(dim)
        if not isinstance(data, tuple | list) or len(data) != 3:
            raise TypeError(f"{where}: a quantized layer takes (packed, scales, biases)")
        packed, scales, biases = (np.asarray(p) for p in data)
        n = packed.shape[0] if packed.ndim == 2 else -1
        if packed.shape != (n, words) or packed.dtype != np.uint32:
            raise ValueError(
                f"{where}: packed must be uint32 (n_tokens, {words}), got {packed.dtype} {packed.shape}"
            )
        for name, part in (("scales", scales), ("biases", biases)):
            if part.shape != (n, groups) or part.dtype != spec.dtype.numpy:
                raise ValueError(f"{where}: {name} must be {spec.dtype.name} (n_tokens, {groups})")
        return spec.quantization.join((packed, scales, biases))

    def append_head(self, layer: int, head: int, k: Any, v: Any, positions: Any, *, seq: int = 0) -> None:
        """Append tokens to one head: ``k`` ``(n_tokens, k_dim)``, ``v`` ``(n_tokens, v_dim)``
        (for a quantized layer, ``(packed, scales, biases)`` tuples)."""
        self._check_open()
        self._layer(layer)
        self._check_seq(seq)
        self._append_head(layer, head, k, v, positions, seq)

    def _gathered(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` as a C-contiguous array: itself, or a copy into a scratch buffer reused from
        chunk to chunk (no fresh allocation, so no page faults, per strided head; mlx-lm keeps V
        as a strided view). Valid until the next call: `_write_chunk` is done with it by then."""
        if rows.flags.c_contiguous:
            return rows
        if self._scratch.nbytes < rows.nbytes:
            self._scratch = np.empty(rows.nbytes, np.uint8)
        out = self._scratch[: rows.nbytes].view(rows.dtype).reshape(rows.shape)
        np.copyto(out, rows)
        return out

    def _append_head(
        self, layer: int, head: int, k: Any, v: Any, positions: Any, seq: int, checked: bool = False
    ) -> None:
        spec = self._layer(layer)
        assert spec.dtype is not None
        if not isinstance(head, int) or not 0 <= head < spec.num_heads:
            raise IndexError(f"head {head} out of range 0..{spec.num_heads - 1} in layer {layer}")
        where = f"layer {layer} head {head}"
        k_rows = self._stored_rows(spec, f"{where} k", k, spec.k_dim)
        v_rows = self._stored_rows(spec, f"{where} v", v, spec.v_dim)
        if k_rows.shape[0] != v_rows.shape[0]:
            raise ValueError(f"{where}: k has {k_rows.shape[0]} tokens, v has {v_rows.shape[0]}")
        count = k_rows.shape[0]
        if checked and positions.shape != (count,):
            raise ValueError(f"positions must have shape ({count},), got {positions.shape}")
        pos = positions if checked else _as_positions(positions, count)
        if count == 0:
            return
        k_key, v_key = (layer, seq, head, KIND_K), (layer, seq, head, KIND_V)
        held = self._live.get(k_key)
        if held and pos[0] < held[-1][3] + held[-1][2]:
            raise ValueError(
                f"layer {layer} head {head} seq {seq}: position {pos[0]} is not after the last "
                f"position held ({held[-1][3] + held[-1][2] - 1})"
            )
        rows_per_chunk = max(1, self.chunk_bytes // max(spec.row_bytes(KIND_K), spec.row_bytes(KIND_V)))
        # Strictly increasing, so a span of count - 1 means one contiguous run (the usual case).
        contiguous = int(pos[-1]) - int(pos[0]) == count - 1
        breaks = np.empty(0, np.int64) if contiguous else np.flatnonzero(np.diff(pos) != 1) + 1
        for start, stop in zip([0, *breaks.tolist()], [*breaks.tolist(), count], strict=True):
            for first in range(start, stop, rows_per_chunk):
                last = min(stop, first + rows_per_chunk)
                position = int(pos[first])
                k_chunk = self._write_chunk(
                    KIND_K,
                    spec.dtype,
                    layer,
                    head,
                    seq,
                    position,
                    self._gathered(k_rows[first:last]),
                    spec.k_dim,
                )
                v_chunk = self._write_chunk(
                    KIND_V,
                    spec.dtype,
                    layer,
                    head,
                    seq,
                    position,
                    self._gathered(v_rows[first:last]),
                    spec.v_dim,
                )
                for key, chunk in ((k_key, k_chunk), (v_key, v_chunk)):
                    run = (chunk, 0, last - first, position)
                    self._live.setdefault(key, []).append(run)
                    self._pending.setdefault(key, []).append(run)
        self._dirty = True

    def drop(self, layer: int, start: int, stop: int, *, seq: int = 0) -> None:
        """Remove positions ``[start, stop)`` from every head of ``layer`` in the live state.

        Nothing is erased from the file; later snapshots simply stop referring to those rows.
        """
        self._check_open()
        self._layer(layer)
        self._check_seq(seq)
        if not (type(start) is int and type(stop) is int and 0 <= start <= stop <= MAX_POSITION):
            raise ValueError(f"drop range must be integers 0 <= start <= stop, got {start}, {stop}")
        for runs_by_key in (self._live, self._pending):
            for key, runs in runs_by_key.items():
                if key[0] == layer and key[1] == seq:
                    runs_by_key[key] = trim(runs, start, stop)
        self._pending_drops.append((layer, seq, start, stop))
        self._dirty = True

    def snapshot(self, metadata: dict[str, Any] | None = None, arrays: dict[str, Any] | None = None) -> int:
        """Commit the live state of every layer as a new snapshot; return its index.

        ``arrays`` attaches named arrays to this snapshot (e.g. ``"last_logits"``:
        ``(num_seqs, vocab)`` float32), each stored as one array chunk.
        """
        self._check_open()
        attached = {name: self._write_array(name, value) for name, value in (arrays or {}).items()}
        entry = Entry(
            parent=len(self._snapshots) - 1 if self._snapshots else None,
            drops=self._pending_drops,
            appends=[run[:3] for key in sorted(self._pending) for run in self._pending[key]],
            metadata=dict(metadata or {}),
            arrays=attached,
        )
        self._write_json_record(KIND_SNAPSHOT, dumps(entry.to_json()))
        self._snapshots.append(entry)
        self._pending, self._pending_drops = {}, []
        self._dirty = False
        return len(self._snapshots) - 1

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def close(self, metadata: dict[str, Any] | None = None) -> None:
        """Commit pending state, write index and footer, fsync and rename into place.

        ``metadata`` keys are merged into the file-level metadata (e.g. the generated text).
        """
        if self._closed:
            return
        if metadata:
            self.manifest.metadata.update(metadata)
        if self._dirty or not self._snapshots:
            self.snapshot()
        self._write(index_bytes(self._offset, self._chunks, self.manifest, self._snapshots))
        self._file.flush()
        if self.durable:
            os.fsync(self._file.fileno())
        self._file.close()
        self._crc_pool.shutdown()
        self._closed = True
        os.replace(self.partial_path, self.path)
        if self.durable:
            fsync_directory(self.path)

    def abort(self) -> None:
        """Stop writing and delete the partial file."""
        if self._closed:
            return
        self._closed = True
        self._file.close()
        self._crc_pool.shutdown()
        os.unlink(self.partial_path)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            # Keep what was written: `kvsnap recover` can rebuild it.
            self._closed = True
            self._file.close()
            self._crc_pool.shutdown()


def index_bytes(
    index_offset: int, chunks: Sequence[Descriptor], manifest: Manifest, snapshots: Sequence[Entry]
) -> bytes:
    """Chunk table, index JSON and footer for a file whose records end at ``index_offset``."""
    table = b"".join(d.pack() for d in chunks)
    index_json = dumps({"manifest": manifest.to_json(), "snapshots": [s.to_json() for s in snapshots]})
    crc = crc32c(index_json, crc32c(table, crc32c(pack_header())))
    footer = Footer(index_offset, len(chunks), len(index_json), crc).pack()
    return table + index_json + footer


def fsync_directory(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class Layer:
    """In-memory K/V of one layer for `save`.

    ``k``: ``(num_heads, n_tokens, k_dim)`` for one sequence, ``(num_seqs, num_heads, n_tokens,
    k_dim)`` for a batch, or a list of per-sequence ``(num_heads, n_i, k_dim)`` arrays (lengths may
    differ). ``v`` likewise. ``positions``: ``(n_tokens,)``, one such array per sequence, or
    ``None`` for ``0..n-1``.
    """

    k: Any
    v: Any
    positions: Any = None
    attributes: dict[str, Any] | None = None


def _per_sequence(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return list(value)
    array = np.asarray(value)
    return list(array) if array.ndim == 4 else [array]


def save(
    path: str | os.PathLike[str],
    layers: Sequence[Layer | None],
    *,
    metadata: dict[str, Any] | None = None,
    codec: str | Codec = "raw",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_seqs: int | None = None,
) -> None:
    """Write in-memory K/V as a single-snapshot file. ``None`` entries are absent layers.

    ``num_seqs`` defaults to what the arrays show (1 if every layer is absent).
    """
    specs: list[LayerSpec | None] = []
    per_layer: list[tuple[list[Any], list[Any], list[Any]] | None] = []
    for index, layer in enumerate(layers):
        if layer is None:
            specs.append(None)
            per_layer.append(None)
            continue
        ks, vs = _per_sequence(layer.k), _per_sequence(layer.v)
        if layer.positions is None:
            positions: list[Any] = [None] * len(ks)
        elif len(ks) == 1 and np.asarray(layer.positions).ndim == 1:
            positions = [layer.positions]
        else:
            positions = list(layer.positions)
        if not (len(ks) == len(vs) == len(positions)):
            raise ValueError(f"layer {index}: k, v and positions disagree on the number of sequences")
        if num_seqs is None:
            num_seqs = len(ks)
        elif num_seqs != len(ks):
            raise ValueError(f"layer {index} has {len(ks)} sequences, earlier layers {num_seqs}")
        first_k, first_v = np.asarray(ks[0]), np.asarray(vs[0])
        if first_k.ndim != 3 or first_v.ndim != 3:
            raise ValueError(f"layer {index}: k and v must be (num_heads, n_tokens, head_dim) per sequence")
        specs.append(
            LayerSpec(
                num_heads=first_k.shape[0],
                k_dim=first_k.shape[2],
                v_dim=first_v.shape[2],
                dtype=dtypes.from_numpy(first_k.dtype),
                attributes=dict(layer.attributes or {}),
            )
        )
        per_layer.append((ks, vs, positions))
    writer = Writer(
        path, specs, num_seqs=num_seqs or 1, metadata=metadata, codec=codec, chunk_bytes=chunk_bytes
    )
    try:
        for index, data in enumerate(per_layer):
            if data is None:
                continue
            for seq, (k, v, pos) in enumerate(zip(*data, strict=True)):
                writer.append(index, k, v, pos, seq=seq)
        writer.close()
    except BaseException:
        writer.abort()
        raise
