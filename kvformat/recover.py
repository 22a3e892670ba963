"""Rebuild a valid file from a ``.partial`` file whose writer never finished.

Records are self-describing, so a scan from offset 64 finds every complete one: a record is
complete when its descriptor CRC holds, it says it lies where it was found, and its payload CRC
holds. The scan stops at the first record that is not complete. Every snapshot committed before
the crash is kept exactly; K/V chunks written after the last committed snapshot are added as one
more snapshot (metadata ``{"recovered": true}``) when both K and V of a run are complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from kvformat import reader
from kvformat.checksum import crc32c
from kvformat.errors import KVFormatError, TruncatedFileError
from kvformat.layout import (
    DESCRIPTOR_DTYPE,
    DESCRIPTOR_SIZE,
    HEADER_SIZE,
    KIND_K,
    KIND_MANIFEST,
    KIND_SNAPSHOT,
    TABLE_KINDS,
    Descriptor,
    align,
    check_header,
)
from kvformat.manifest import Manifest, loads, parse_manifest
from kvformat.series import Chain, Entry, parse_entry
from kvformat.source import MmapSource
from kvformat.writer import fsync_directory, index_bytes


@dataclass(frozen=True)
class RecoverReport:
    """What `recover` kept: the output path, complete chunks, snapshots, and dropped bytes."""

    path: str
    chunks: int
    snapshots: int
    recovered_snapshot: bool
    bytes_dropped: int


def _scan(source: MmapSource) -> tuple[int, Manifest, list[Descriptor], list[Entry], int]:
    """Return the end of the last complete record, the manifest, chunks, snapshots, and how
    many chunks precede the last snapshot record."""
    check_header(bytes(source.read(0, HEADER_SIZE)))
    cursor = HEADER_SIZE
    manifest: Manifest | None = None
    chunks: list[Descriptor] = []
    snapshots: list[Entry] = []
    good_end = HEADER_SIZE
    committed = 0
    while cursor + DESCRIPTOR_SIZE <= source.size:
        try:
            desc = Descriptor.unpack(source.read(cursor, DESCRIPTOR_SIZE))
        except KVFormatError:
            break
        if desc.offset != cursor or desc.end > source.size:
            break
        payload = source.read(desc.payload_offset, desc.stored_size)
        if crc32c(payload) != desc.payload_crc:
            break
        try:
            if manifest is None:
                if desc.kind != KIND_MANIFEST:
                    break
                manifest = parse_manifest(loads(payload, "manifest record"))
            elif desc.kind == KIND_SNAPSHOT:
                document = loads(payload, "snapshot record")
                layers, seqs = len(manifest.layers), manifest.num_seqs
                snapshots.append(parse_entry(document, len(snapshots), layers, seqs))
                committed = len(chunks)
            elif desc.kind in TABLE_KINDS:
                chunks.append(desc)
        except KVFormatError:
            break
        good_end = desc.end
        cursor = align(desc.end)
    if manifest is None:
        raise TruncatedFileError(f"{source.name}: no complete manifest record; nothing to recover")
    return good_end, manifest, chunks, snapshots, committed


def _trailing_snapshot(chunks: list[Descriptor], snapshots: list[Entry], committed: int) -> Entry | None:
    """A snapshot adding the complete K/V runs written after the last committed one (None if
    there are none and a snapshot exists)."""
    held_end: dict[tuple[int, int, int], int] = {}
    if snapshots:
        table = np.frombuffer(b"".join(d.pack() for d in chunks), dtype=DESCRIPTOR_DTYPE)
        for (layer, seq, head, _kind), runs in Chain(snapshots, table).state(len(snapshots) - 1).items():
            if runs:
                end = max(run[3] + run[2] for run in runs)
                held_end[(layer, seq, head)] = max(held_end.get((layer, seq, head), 0), end)
    pending: dict[tuple[int, int, int, int, int], int] = {}
    appends: list[tuple[int, int, int]] = []
    for i in range(committed, len(chunks)):
        d = chunks[i]
        run = (d.layer, d.seq, d.head, d.position, d.rows)
        if d.kind == KIND_K:
            pending[run] = i
        elif run in pending:
            k = pending.pop(run)
            key = (d.layer, d.seq, d.head)
            if d.position >= held_end.get(key, 0) and d.rows:
                appends += [(k, 0, d.rows), (i, 0, d.rows)]
                held_end[key] = d.position + d.rows
    if not appends and snapshots:
        return None
    parent = len(snapshots) - 1 if snapshots else None
    return Entry(parent, [], appends, {"recovered": True})


def recover(
    partial_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
) -> RecoverReport:
    """Turn ``X.kv.partial`` into ``X.kv`` (or ``out_path``) holding every complete chunk.

    The partial file is truncated after its last complete record and given an index, in place,
    then renamed; nothing is copied. Running it again after a crash mid-recovery is safe.
    """
    partial = os.fspath(partial_path)
    if out_path is None:
        if not partial.endswith(".partial"):
            raise ValueError(f"{partial} does not end in .partial; give an output path")
        out = partial[: -len(".partial")]
    else:
        out = os.fspath(out_path)
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--force) to replace it")
    source = MmapSource(partial)
    try:
        good_end, manifest, chunks, snapshots, committed = _scan(source)
    finally:
        source.close()
    trailing = _trailing_snapshot(chunks, snapshots, committed)
    if trailing is not None:
        snapshots.append(trailing)
    index_offset = align(good_end)
    with open(partial, "r+b") as f:
        dropped = os.fstat(f.fileno()).st_size - good_end
        f.truncate(good_end)
        f.seek(good_end)
        f.write(bytes(index_offset - good_end))
        f.write(index_bytes(index_offset, [chunk.pack() for chunk in chunks], manifest, snapshots))
        f.flush()
        os.fsync(f.fileno())
    with reader.open(partial) as snap:
        snap.check_snapshots()  # every snapshot materializes (each entry checked once)
    os.replace(partial, out)
    fsync_directory(out)
    return RecoverReport(out, len(chunks), len(snapshots), trailing is not None, max(dropped, 0))
