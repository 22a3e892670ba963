"""One work unit of the writer as records: gather strided rows, encode, checksum, lay out.

`prepare` runs on the writer's helper thread for pipelined appends; it touches nothing but the
unit's arrays and the scratch buffer it is given (returned, grown if needed). Blocks of small raw
chunks take `kvformat.records.block_records`, which copies them into one buffer; everything else
keeps one payload per chunk, written from the caller's memory where it is contiguous.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from kvformat.checksum import crc32c_many
from kvformat.codecs import BytesLike, Codec
from kvformat.layout import ALIGN, DESCRIPTOR_SIZE
from kvformat.records import (
    Block,
    Part,
    Records,
    Unit,
    block_columns,
    block_records,
    byte_view,
    crc_of,
    layout,
    small_chunks,
)
from kvformat.runs import CHUNK

ZEROS = bytes(ALIGN)
"""Padding source: records end on `kvformat.layout.ALIGN`-byte boundaries."""


@dataclass
class _Chunks:
    """A unit's chunks gathered in record order, before their descriptors are laid out: per group
    of chunks the ``(n, 8)`` columns (decoded size in the chunk column), widths and dtype codes;
    one payload per chunk, or for codecs that encode to several pieces, those in ``pieces``."""

    columns: list[np.ndarray] = field(default_factory=list)
    widths: list[np.ndarray] = field(default_factory=list)
    dtype_codes: list[np.ndarray] = field(default_factory=list)
    payloads: list[BytesLike] = field(default_factory=list)
    pieces: dict[int, list[BytesLike]] = field(default_factory=dict)

    def add_blocks(self, blocks: list[Block]) -> None:
        """Raw blocks: one payload per head and kind, views of the block's arrays."""
        columns, widths, dtype_codes = block_columns(blocks)
        self.columns.append(columns)
        self.widths.append(widths)
        self.dtype_codes.append(dtype_codes)
        for block in blocks:
            k_size, v_size = block.k[0].nbytes, block.v[0].nbytes
            k_bytes, v_bytes = byte_view(block.k), byte_view(block.v)
            for h in range(block.k.shape[0]):
                self.payloads.append(k_bytes[h * k_size : (h + 1) * k_size])
                self.payloads.append(v_bytes[h * v_size : (h + 1) * v_size])

    def add_raw_parts(self, parts: list[Part], rows: list[np.ndarray]) -> None:
        """Chunks stored as they are (the raw codec), ``rows`` C-contiguous: their columns built
        with one numpy call per field for the whole run (a snapshot's queries are thousands of
        small chunks: one per query head, layer and run of positions)."""
        pairs = zip(parts, rows, strict=True)
        # The decoded size rides in the CHUNK column (index 4) until the chunk index is known.
        fields = [(p.layer, p.seq, p.head, p.kind, r.nbytes, 0, r.shape[0], p.position) for p, r in pairs]
        columns = np.array(fields, np.int64).reshape(-1, 8)
        self.columns.append(columns)
        self.widths.append(np.array([p.width for p in parts], np.int64))
        self.dtype_codes.append(np.array([p.dtype.code for p in parts], np.int64))
        self.payloads += [byte_view(r) for r in rows]

    def add_part(self, part: Part, rows: np.ndarray, codec: Codec) -> None:
        """One chunk, ``rows`` C-contiguous, encoded by ``codec``."""
        data = byte_view(rows)
        pieces = codec.encode(data, part.dtype.itemsize)
        if len(pieces) != 1:
            self.pieces[len(self.payloads)] = pieces
        self.payloads.append(pieces[0] if len(pieces) == 1 else data)
        # The decoded size rides in the CHUNK column until the chunk index is known.
        columns = np.array([[part.layer, part.seq, part.head, part.kind, 0, 0, rows.shape[0], part.position]])
        columns[0, CHUNK] = data.nbytes
        self.columns.append(columns)
        self.widths.append(np.array([part.width]))
        self.dtype_codes.append(np.array([part.dtype.code]))


def prepare(unit: Unit, codec: Codec, scratch: np.ndarray, offset: int) -> tuple[Records, np.ndarray]:
    """The records of ``unit`` laid out from file offset ``offset``, and the scratch buffer
    (``scratch``, or a larger one) that holds the unit's gathered strided rows until written."""
    if all(isinstance(item, Block) for item in unit) and small_chunks(cast(list[Block], unit)):
        return block_records(cast(list[Block], unit), offset, scratch)
    strided = _strided_bytes(unit)
    if scratch.nbytes < strided:
        scratch = np.empty(strided, np.uint8)
    chunks, used = _Chunks(), 0
    for is_block, run in itertools.groupby(unit, key=lambda item: isinstance(item, Block)):
        if is_block:
            chunks.add_blocks(cast(list[Block], list(run)))
            continue
        if codec.code == 0:  # raw: no per-chunk encoding, the columns made for the run at once
            parts = cast(list[Part], list(run))
            gathered = []
            for part in parts:
                rows, used = _contiguous(part.rows, scratch, used)
                gathered.append(rows)
            chunks.add_raw_parts(parts, gathered)
            continue
        for part in cast(Iterator[Part], run):
            rows, used = _contiguous(part.rows, scratch, used)
            chunks.add_part(part, rows, codec)
    return _records(chunks, codec, offset), scratch


def _strided_bytes(unit: Unit) -> int:
    """The bytes of the unit's parts whose rows are not C-contiguous (gathered before writing)."""
    return sum(p.rows.nbytes for p in unit if isinstance(p, Part) and not p.rows.flags.c_contiguous)


def _contiguous(rows: np.ndarray, scratch: np.ndarray, used: int) -> tuple[np.ndarray, int]:
    """``rows`` themselves where C-contiguous, else gathered into ``scratch`` from byte
    ``used`` on; and the scratch bytes used after them."""
    if rows.flags.c_contiguous:
        return rows, used
    out = scratch[used : used + rows.nbytes].view(rows.dtype).reshape(rows.shape)
    np.copyto(out, rows)
    return out, used + rows.nbytes


def _records(chunks: _Chunks, codec: Codec, offset: int) -> Records:
    """Descriptors (sizes, CRC-32C, offsets) for gathered ``chunks`` and the buffers to write."""
    payloads, multi = chunks.payloads, chunks.pieces
    if not payloads:
        return Records([], b"", np.empty((0, 8), np.int64), offset, offset)
    table = np.concatenate(chunks.columns)
    decoded = table[:, CHUNK].copy()
    stored = decoded.copy() if codec.code == 0 else np.array([len(p) for p in payloads], np.int64)
    crcs = crc32c_many(payloads)
    for index, pieces in multi.items():  # CRCs continue across the pieces of one payload
        crcs[index] = crc_of(pieces)
        stored[index] = sum(memoryview(p).nbytes for p in pieces)
    packed, padding, end = layout(
        table,
        np.concatenate(chunks.widths),
        np.concatenate(chunks.dtype_codes),
        codec.code,
        stored,
        decoded,
        crcs,
        offset,
    )
    buffers = _buffers(memoryview(packed), payloads, multi, padding)
    return Records(buffers, packed, table, offset, end)


def _buffers(
    descriptors: memoryview,
    payloads: list[BytesLike],
    pieces: dict[int, list[BytesLike]],
    padding: np.ndarray,
) -> list[BytesLike]:
    """What to write, in order: per chunk its descriptor, its payload (or the pieces of it), and
    its padding to the next record."""
    n = len(payloads)
    if not pieces and not padding.any():  # the usual raw case: descriptor, payload, ...
        buffers: list[BytesLike] = [b""] * (2 * n)
        buffers[0::2] = [descriptors[d : d + DESCRIPTOR_SIZE] for d in range(0, n * DESCRIPTOR_SIZE, 64)]
        buffers[1::2] = payloads
        return buffers
    buffers = []
    for index, (payload, pad) in enumerate(zip(payloads, padding.tolist(), strict=True)):
        buffers.append(descriptors[index * DESCRIPTOR_SIZE : (index + 1) * DESCRIPTOR_SIZE])
        buffers += pieces.get(index, [payload])
        if pad:
            buffers.append(ZEROS[:pad])
    return buffers
