"""Laying out the records of table chunks (SPEC section 6): what `Writer` prepares and writes.

A `Part` is one chunk of one head (rows maybe strided, any codec); a `Block` is every head of
one layer and sequence stored raw, laid out with numpy instead of chunk by chunk (the common
case of a series snapshot: hundreds of small chunks). `layout` builds the descriptors of
consecutive records in bulk; `Records` is a prepared unit ready to write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat.checksum import crc32c, crc32c_rows, crc32c_slices
from kvformat.codecs import BytesLike
from kvformat.dtypes import DType
from kvformat.layout import ALIGN, DESCRIPTOR_DTYPE, DESCRIPTOR_SIZE, KIND_K, KIND_V
from kvformat.runs import CHUNK, COUNT, HEAD, KIND, LAYER, POSITION, ROW, SEQ


def byte_view(array: np.ndarray) -> memoryview:
    """A zero-copy byte view of a C-contiguous array (bfloat16 included)."""
    return array.reshape(-1).view(np.uint8).data


def flat(buffer: BytesLike) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclass
class Part:
    """One table chunk to write: ``rows`` ``(n, ...)`` as stored before the codec, maybe strided;
    ``width`` in elements."""

    kind: int
    layer: int
    seq: int
    head: int
    position: int
    rows: np.ndarray
    width: int
    dtype: DType

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


@dataclass
class Block:
    """Every head of one layer and sequence at once, one chunk per head and kind, stored raw:
    ``k`` ``(num_heads, n, k_dim)`` and ``v`` ``(num_heads, n, v_dim)``, both C-contiguous, at
    positions ``position .. position + n - 1``. Its records are laid out with numpy, not per
    chunk (the common case of a series snapshot: hundreds of small chunks)."""

    layer: int
    seq: int
    position: int
    k: np.ndarray
    v: np.ndarray
    dtype: DType

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


Unit = list[Part | Block]
"""Chunks prepared together (on the helper thread when pipelined) and written with one ``writev``."""


@dataclass
class Records:
    """Prepared records laid out from file offset ``start``: what to write (descriptor, payload,
    padding per chunk), the packed descriptors, the chunk columns and the offset just past them."""

    buffers: list[BytesLike]
    packed: bytes
    columns: np.ndarray  # (n, 8) int64: layer, seq, head, kind, 0, 0, rows, position
    start: int
    end: int


def block_columns(blocks: list[Block]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunk columns (decoded size in the chunk column), widths and dtype codes of consecutive
    blocks, in record order: block by block, head by head, K before V."""
    heads = np.array([b.k.shape[0] for b in blocks])
    per_block = np.array(
        [
            (
                b.layer,
                b.seq,
                b.position,
                b.k.shape[1],
                b.k.shape[2],
                b.v.shape[2],
                b.dtype.code,
                b.dtype.itemsize,
            )
            for b in blocks
        ],
        np.int64,
    )
    each = np.repeat(per_block, 2 * heads, axis=0)  # one row per chunk
    n = each.shape[0]
    is_v = np.tile([False, True], n // 2)
    head = np.arange(n) // 2 - np.repeat(np.cumsum(heads) - heads, 2 * heads)
    width = np.where(is_v, each[:, 5], each[:, 4])
    columns = np.empty((n, 8), np.int64)
    columns[:, LAYER], columns[:, SEQ], columns[:, HEAD] = each[:, 0], each[:, 1], head
    columns[:, KIND] = np.where(is_v, KIND_V, KIND_K)
    columns[:, CHUNK] = each[:, 3] * width * each[:, 7]
    columns[:, ROW], columns[:, COUNT], columns[:, POSITION] = 0, each[:, 3], each[:, 2]
    return columns, width, each[:, 6]


def layout(
    columns: np.ndarray,
    widths: np.ndarray,
    dtype_codes: np.ndarray,
    codec: int,
    stored: np.ndarray,
    decoded: np.ndarray,
    crcs: np.ndarray,
    start: int,
) -> tuple[bytes, np.ndarray, int]:
    """Descriptors of consecutive records from file offset ``start``, built with numpy: the packed
    descriptors, each record's padding, and the offset after the last."""
    n = columns.shape[0]
    spans = DESCRIPTOR_SIZE + stored
    padded = (spans + (ALIGN - 1)) // ALIGN * ALIGN
    offsets = np.empty(n, np.int64)
    offsets[0] = start
    np.cumsum(padded[:-1], out=offsets[1:])
    offsets[1:] += start
    table = np.zeros(n, DESCRIPTOR_DTYPE)
    table["magic"] = b"KVCK"
    table["kind"] = columns[:, KIND]
    table["dtype"] = dtype_codes
    table["codec"] = codec
    table["layer"] = columns[:, LAYER]
    table["head"] = columns[:, HEAD]
    table["seq"] = columns[:, SEQ]
    table["position"] = columns[:, POSITION]
    table["rows"] = columns[:, COUNT]
    table["width"] = widths
    table["offset"] = offsets
    table["stored_size"] = stored
    table["decoded_size"] = decoded
    table["payload_crc"] = crcs
    raw = table.view(np.uint8).reshape(n, DESCRIPTOR_SIZE)
    table["descriptor_crc"] = crc32c_rows(raw[:, :60])
    return table.tobytes(), padded - spans, int(start + padded.sum())


SMALL_CHUNK_BYTES = 64 << 10
"""Blocks whose chunks average at most this many bytes are copied into one buffer and written
with one ``write`` (`block_records`); larger ones go out with ``writev`` straight from the
caller's arrays (a copy would cost more than the buffers it saves)."""


def small_chunks(blocks: list[Block]) -> bool:
    """Whether ``blocks``' chunks are small enough on average for `block_records`."""
    chunks = sum(2 * block.k.shape[0] for block in blocks)
    return chunks > 0 and sum(block.nbytes for block in blocks) <= chunks * SMALL_CHUNK_BYTES


@dataclass
class _Plan:
    """Everything about the records of a sequence of blocks that depends only on their layers,
    shapes and dtypes (a series repeats the same sequence snapshot after snapshot): chunk columns
    and descriptors with the positions, offsets and CRCs left to fill in, and the layout."""

    columns: np.ndarray  # (n, 8), POSITION 0
    repeats: np.ndarray  # chunks per block: a block's position repeated so many times
    table: np.ndarray  # (n,) DESCRIPTOR_DTYPE; position, offset (from 0) and CRCs to fill in
    offsets: np.ndarray  # (n,) int64: each record's offset from the first
    crc_starts: list[int]  # each payload's offset from the first record, for the CRC loop
    sizes: list[int]  # each payload's size
    total: int  # bytes of all records
    uniform: bool  # every record the same size
    runs: list[_Run]  # the runs of equal-shape blocks that hold heads


@dataclass(frozen=True)
class _Run:
    """Consecutive blocks of one shape, laid out as ``(blocks, heads, K record + V record)``
    bytes from ``offset``; byte positions within a K + V record pair."""

    first_block: int
    blocks: int
    heads: int
    rows: int
    k_dim: int
    v_dim: int
    first_record: int
    offset: int
    k_record: int  # bytes of a K record (descriptor, payload, padding)
    pair: int  # bytes of a K record and its V record
    k_end: int  # where K's payload ends
    v_start: int  # where V's payload starts
    v_end: int  # where V's payload ends


_PLANS: dict[tuple[tuple[Any, ...], ...], _Plan] = {}
_MAX_PLANS = 64


def _plan(blocks: list[Block]) -> _Plan:
    key = tuple((b.layer, b.seq, b.k.shape, b.v.shape, b.dtype.code) for b in blocks)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    columns, widths, dtype_codes = block_columns(blocks)
    decoded = columns[:, CHUNK].copy()
    columns[:, POSITION] = 0
    crcs = np.zeros(len(decoded), np.uint32)
    packed, padding, total = layout(columns, widths, dtype_codes, 0, decoded, decoded, crcs, 0)
    table = np.frombuffer(packed, DESCRIPTOR_DTYPE).copy()
    offsets = table["offset"].astype(np.int64)
    padded = DESCRIPTOR_SIZE + decoded + padding
    runs = []
    first_block = first = 0
    for run in _equal_shapes(blocks):
        count, (heads, rows, k_dim), v_dim = len(run), run[0].k.shape, run[0].v.shape[2]
        if heads:
            k_record = int(padded[first])
            v_start = k_record + DESCRIPTOR_SIZE
            runs.append(
                _Run(
                    first_block=first_block,
                    blocks=count,
                    heads=heads,
                    rows=rows,
                    k_dim=k_dim,
                    v_dim=v_dim,
                    first_record=first,
                    offset=int(offsets[first]),
                    k_record=k_record,
                    pair=k_record + int(padded[first + 1]),
                    k_end=DESCRIPTOR_SIZE + int(decoded[first]),
                    v_start=v_start,
                    v_end=v_start + int(decoded[first + 1]),
                )
            )
        first_block += count
        first += 2 * count * heads
    plan = _Plan(
        columns=columns,
        repeats=np.array([2 * b.k.shape[0] for b in blocks]),
        table=table,
        offsets=offsets,
        crc_starts=(offsets + DESCRIPTOR_SIZE).tolist(),
        sizes=decoded.tolist(),
        total=total,
        uniform=int(padded.min()) == int(padded.max()),
        runs=runs,
    )
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def block_records(blocks: list[Block], start: int, scratch: np.ndarray) -> tuple[Records, np.ndarray]:
    """The records of consecutive raw ``blocks`` from file offset ``start``, laid out in one
    contiguous buffer (``scratch`` when it is large enough, else a new one, returned with the
    records): each run of equal-shape blocks' payloads copied with two numpy calls, the CRCs
    taken with one loop of C calls over the buffer and the descriptors filled in from a plan
    made once per sequence of shapes (`_Plan`). A snapshot of hundreds of small chunks is then
    one ``write`` with no Python work per chunk but the CRC call."""
    plan = _plan(blocks)
    n, total = plan.table.shape[0], plan.total
    if scratch.nbytes < total:
        scratch = np.empty(total, np.uint8)
    out = scratch[:total]
    views: list[np.ndarray] = []  # per run: its (blocks x heads, K + V record) bytes
    for r in plan.runs:
        run = blocks[r.first_block : r.first_block + r.blocks]
        view = out[r.offset : r.offset + r.blocks * r.heads * r.pair].reshape(r.blocks, r.heads, r.pair)
        dtype = run[0].k.dtype
        k_view = view[:, :, DESCRIPTOR_SIZE : r.k_end].view(dtype)
        v_view = view[:, :, r.v_start : r.v_end].view(dtype)
        np.stack([block.k for block in run], out=k_view.reshape(r.blocks, r.heads, r.rows, r.k_dim))
        np.stack([block.v for block in run], out=v_view.reshape(r.blocks, r.heads, r.rows, r.v_dim))
        view[:, :, r.k_end : r.k_record] = 0
        view[:, :, r.v_end :] = 0
        views.append(view.reshape(r.blocks * r.heads, r.pair))
    positions = np.repeat(np.array([block.position for block in blocks], np.int64), plan.repeats)
    table = plan.table.copy()
    table["position"] = positions
    table["offset"] = plan.offsets + start
    table["payload_crc"] = crc32c_slices(out.data, plan.crc_starts, plan.sizes)
    raw = table.view(np.uint8).reshape(n, DESCRIPTOR_SIZE)
    table["descriptor_crc"] = crc32c_rows(raw[:, :60])
    if plan.uniform:  # every record the same size: one copy
        out.reshape(n, -1)[:, :DESCRIPTOR_SIZE] = raw
    else:
        for r, view in zip(plan.runs, views, strict=True):
            first, stop = r.first_record, r.first_record + 2 * view.shape[0]
            view[:, :DESCRIPTOR_SIZE] = raw[first:stop:2]
            view[:, r.k_record : r.k_record + DESCRIPTOR_SIZE] = raw[first + 1 : stop : 2]
    columns = plan.columns.copy()
    columns[:, POSITION] = positions
    return Records([out.data], table.tobytes(), columns, start, start + total), scratch


def _equal_shapes(blocks: list[Block]) -> list[list[Block]]:
    """``blocks`` cut into runs of consecutive blocks of one shape and dtype (every layer of a
    model, usually: one run)."""
    runs: list[list[Block]] = []
    key = None
    for block in blocks:
        this = (block.k.shape, block.v.shape, block.k.dtype)
        if this != key:
            runs.append([])
            key = this
        runs[-1].append(block)
    return runs


def crc_of(pieces: list[BytesLike]) -> int:
    crc = 0
    for piece in pieces:
        crc = crc32c(piece, crc)
    return crc
