"""Rewrite a file's index with edits and *valid* checksums: the tool that makes hostile test files
(`spec/vectors/generate.py`'s bad vectors, `tests/kvformat/test_hostile.py`), where only the structural
rule under test may catch the damage, not a CRC.

    rebuild_index(source, out, edit_table=..., edit_json=..., footer={...})
    as_triples(source, out)  # a 1.2 series as a 1.1 writer stored it

Never used to write ordinary files: `kvformat.Writer` does that.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvformat.checksum import crc32c
from kvformat.layout import DESCRIPTOR_DTYPE, DESCRIPTOR_SIZE, FOOTER_SIZE, Footer


def rebuild_index(
    source: Path,
    out: Path,
    edit_table: Callable[[np.ndarray], None] | None = None,
    edit_json: Callable[[dict[str, Any]], object] | None = None,
    footer: dict[str, int] | None = None,
    descriptor_crcs: bool = True,
) -> None:
    """Write ``source`` to ``out`` with its index edited: ``edit_table`` changes the chunk table
    (a ``DESCRIPTOR_DTYPE`` array) in place, and every descriptor CRC is recomputed;
    ``edit_json`` changes the index JSON in place or returns a replacement (a document, or raw
    bytes); ``footer`` overrides footer fields (``index_offset``, ``chunk_count``, ``json_size``,
    ``minor``). The index CRC is recomputed over the result. ``descriptor_crcs=False`` leaves
    the edited table's descriptor CRCs as they are (a table whose own CRCs are wrong)."""
    data = source.read_bytes()
    f = Footer.unpack(data[-FOOTER_SIZE:])
    table_end = f.index_offset + f.chunk_count * DESCRIPTOR_SIZE
    table = np.frombuffer(data[f.index_offset : table_end], DESCRIPTOR_DTYPE).copy()
    document = json.loads(data[table_end:-FOOTER_SIZE])
    if edit_table:
        edit_table(table)
    if edit_table and descriptor_crcs:
        raw = table.view(np.uint8).reshape(len(table), DESCRIPTOR_SIZE)
        table["descriptor_crc"] = [crc32c(bytes(row[:60])) for row in raw]
    if edit_json:
        replaced = edit_json(document)
        if replaced is not None:
            document = replaced
    index_json = document if isinstance(document, bytes) else json.dumps(document).encode()
    fields = {"index_offset": f.index_offset, "chunk_count": len(table), "json_size": len(index_json)}
    fields.update(footer or {})
    crc = crc32c(index_json, crc32c(table.tobytes(), crc32c(data[:64])))
    minor = struct.unpack_from("<H", data, 10)[0]  # the footer repeats the header's minor version
    minor = fields.get("minor", minor)
    footer_bytes = Footer(
        fields["index_offset"], fields["chunk_count"], fields["json_size"], crc, minor
    ).pack()
    out.write_bytes(data[: f.index_offset] + table.tobytes() + index_json + footer_bytes)


def as_triples(source: Path, out: Path) -> None:
    """``source`` with its ``append_chunks`` ranges written as (chunk, row, count) triples in the
    index, as a writer before 1.2 stored every snapshot."""
    data = source.read_bytes()
    f = Footer.unpack(data[-FOOTER_SIZE:])
    rows = np.frombuffer(data[f.index_offset :], DESCRIPTOR_DTYPE, count=f.chunk_count)["rows"].tolist()

    def expand(document: dict[str, Any]) -> None:
        for entry in document["snapshots"]:
            ranges = entry.pop("append_chunks", [])
            for first, stop in zip(ranges[::2], ranges[1::2], strict=True):
                entry["append"] += [x for c in range(first, stop) for x in (c, 0, rows[c])]
        features = document["manifest"]["required_features"]
        if "append-chunks" in features:
            features.remove("append-chunks")

    rebuild_index(source, out, edit_json=expand)


def empty_chunks(
    source: Path,
    out: Path,
    positions: dict[int, int],
    moves: dict[int, int] | None = None,
    edit_json: Callable[[dict[str, Any]], object] | None = None,
) -> None:
    """``source`` with the table chunks ``positions``' keys made chunks of 0 rows at the given
    positions: the record stream is laid out again without their payloads (every later record
    moves up, its descriptor's offset and CRC rewritten, and the table with it), their
    descriptors say 0 rows, 0 bytes and the CRC of nothing. ``moves``: other chunks given
    another position (in the stream and the table alike). Then `rebuild_index` with
    ``edit_json``."""
    moves = moves or {}
    data = source.read_bytes()
    f = Footer.unpack(data[-FOOTER_SIZE:])
    table_end = f.index_offset + f.chunk_count * DESCRIPTOR_SIZE
    table = np.frombuffer(data[f.index_offset : table_end], DESCRIPTOR_DTYPE).copy()
    chunk_at = {int(offset): i for i, offset in enumerate(table["offset"].tolist())}
    stream = bytearray(data[:64])
    cursor = 64
    while cursor < f.index_offset:
        descriptor = np.frombuffer(data[cursor : cursor + DESCRIPTOR_SIZE], DESCRIPTOR_DTYPE).copy()
        size = int(descriptor["stored_size"][0])
        payload = data[cursor + DESCRIPTOR_SIZE : cursor + DESCRIPTOR_SIZE + size]
        chunk = chunk_at.get(cursor)
        if chunk is not None and chunk in positions:
            payload = b""
            for name in ("rows", "decoded_size", "stored_size", "payload_crc"):
                descriptor[name] = 0
            descriptor["position"] = positions[chunk]
        if chunk is not None and chunk in moves:
            descriptor["position"] = moves[chunk]
        descriptor["offset"] = len(stream)
        descriptor["descriptor_crc"] = crc32c(bytes(descriptor.view(np.uint8)[:60]))
        if chunk is not None:
            table[chunk] = descriptor[0]
        stream += descriptor.tobytes() + payload
        stream += bytes(-len(stream) % 64)
        cursor += DESCRIPTOR_SIZE + size
        cursor += -cursor % 64
    index_json = data[table_end:-FOOTER_SIZE]
    crc = crc32c(index_json, crc32c(table.tobytes(), crc32c(bytes(stream[:64]))))
    minor = struct.unpack_from("<H", data, 10)[0]
    footer = Footer(len(stream), len(table), len(index_json), crc, minor).pack()
    staged = out.with_name(out.name + ".staged")
    staged.write_bytes(bytes(stream) + table.tobytes() + index_json + footer)
    try:
        rebuild_index(staged, out, edit_json=edit_json)
    finally:
        staged.unlink()
