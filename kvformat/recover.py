"""Rebuild a valid file from a ``.partial`` file whose writer never finished.

The input is only read: the complete records are copied to a new file, which gets an index and
footer, is checked, and is renamed into place (`kvformat.io.outputs`).

Records are self-describing, so a scan from offset 64 finds every complete one: a record is
complete when its descriptor CRC holds, it says it lies where it was found, and its payload CRC
holds. The scan stops at the first record that is not complete. Every snapshot committed before
the crash is kept exactly; K/V chunks written after the last committed snapshot are added as one
more snapshot (metadata ``{"recovered": true}``) when both K and V of a run are complete.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat import reader
from kvformat.checksum import crc32c, crc32c_rows, crc32c_slices, linear_crc, records_linear
from kvformat.errors import FileInUseError, IncompleteRecoveryError, KVFormatError, TruncatedFileError
from kvformat.index import index_bytes
from kvformat.io.durability import fsync_directory
from kvformat.io.outputs import check_output, in_use, output_path
from kvformat.io.source import MmapSource
from kvformat.layout import (
    DESCRIPTOR_DTYPE,
    DESCRIPTOR_SIZE,
    HEADER_SIZE,
    KIND_K,
    KIND_MANIFEST,
    KIND_SNAPSHOT,
    KIND_V,
    TABLE_KINDS,
    Descriptor,
    align,
    check_header,
)
from kvformat.manifest import Manifest, loads, parse_manifest
from kvformat.runs import COUNT, HEAD, LAYER, POSITION, SEQ
from kvformat.series import Chain, Entry, parse_entry


@dataclass(frozen=True)
class RecoverReport:
    """What `recover` kept: the output path, complete chunks, snapshots, and dropped bytes."""

    path: str | None  # None: the input was complete and valid; nothing was written
    chunks: int
    snapshots: int  # in the output, the rebuilt one included
    recovered_snapshot: bool  # the last of them was rebuilt from chunks after the last commit
    bytes_dropped: int  # of the input, after its last complete record
    rows_left_out: int = 0  # complete K/V rows past the rebuilt snapshot's end (heads ahead of others)
    cut_at: int | None = None  # the position the rebuilt snapshot ends at, where rows were left out
    short_layers: tuple[int, ...] = ()  # layers with a head that stopped at ``cut_at``

    def describe_cut(self) -> str:
        """One sentence on what the rebuilt snapshot left out ("" if nothing)."""
        if not self.rows_left_out:
            return ""
        layers = ", ".join(map(str, self.short_layers[:8])) + (" ..." if len(self.short_layers) > 8 else "")
        return (
            f"the rebuilt snapshot ends at position {self.cut_at}, where the heads of layer(s) {layers} "
            f"stopped; {self.rows_left_out} K/V rows written past it by other heads are left out"
        )


_BULK = 4096  # records checked together when the next ones are predicted


def _scan(source: MmapSource) -> tuple[int, Manifest, list[bytes], list[Entry], int]:
    """Return the end of the last complete record, the manifest, the packed descriptors of the
    table chunks (blocks of 64-byte descriptors), the snapshots, and how many chunks precede
    the last snapshot record.

    A table chunk of ``S`` payload bytes is often followed by more of the same size (a series
    writes every head alike): those are predicted, checked in bulk (`_complete_run`) and taken as
    far as they hold; the scan goes on record by record from the first that does not."""
    check_header(bytes(source.read(0, HEADER_SIZE)))
    cursor = HEADER_SIZE
    manifest: Manifest | None = None
    blocks: list[bytes] = []
    chunks = 0
    snapshots: list[Entry] = []
    good_end = HEADER_SIZE
    committed = 0
    while cursor + DESCRIPTOR_SIZE <= source.size:
        if manifest is not None:
            taken, end = _complete_run(source, cursor)
            if taken:
                blocks.append(_descriptors(source, cursor, taken))
                chunks += taken
                good_end = end
                cursor = align(end)
                continue
        found = _whole_record(source, cursor)
        if found is None:
            break
        desc, payload = found
        try:
            if manifest is None:
                if desc.kind != KIND_MANIFEST:
                    break
                manifest = parse_manifest(loads(payload, "manifest record"))
            elif desc.kind == KIND_SNAPSHOT:
                document = loads(payload, "snapshot record")
                layers, seqs = len(manifest.layers), manifest.num_seqs
                snapshots.append(parse_entry(document, len(snapshots), layers, seqs))
                committed = chunks
            elif desc.kind in TABLE_KINDS:
                blocks.append(bytes(source.read(cursor, DESCRIPTOR_SIZE)))
                chunks += 1
        except KVFormatError:
            break
        good_end = desc.end
        cursor = align(desc.end)
    if manifest is None:
        raise TruncatedFileError(f"{source.name}: no complete manifest record; nothing to recover")
    return good_end, manifest, blocks, snapshots, committed


def _whole_record(source: MmapSource, cursor: int) -> tuple[Descriptor, Any] | None:
    """The descriptor and payload of the record at ``cursor`` where it is whole (a descriptor
    that says it lies there, a payload inside the file that has its checksum), else None."""
    try:
        desc = Descriptor.unpack(source.read(cursor, DESCRIPTOR_SIZE))
    except KVFormatError:
        return None
    if desc.offset != cursor or desc.end > source.size:
        return None
    payload = source.read(desc.payload_offset, desc.stored_size)
    return (desc, payload) if crc32c(payload) == desc.payload_crc else None


def _descriptors(source: MmapSource, cursor: int, count: int) -> bytes:
    """The ``count`` descriptors of the equal-stride records from ``cursor`` (checked already)."""
    head = np.frombuffer(source.read(cursor, DESCRIPTOR_SIZE), DESCRIPTOR_DTYPE)[0]
    stride = align(DESCRIPTOR_SIZE + int(head["stored_size"]))
    span = np.frombuffer(source.read(cursor, (count - 1) * stride + DESCRIPTOR_SIZE), np.uint8)
    return np.ndarray((count, DESCRIPTOR_SIZE), np.uint8, buffer=span, strides=(stride, 1)).tobytes()


def _complete_run(source: MmapSource, cursor: int) -> tuple[int, int]:
    """How many complete table-chunk records lie at ``cursor`` with the stored size of the first,
    back to back (0 if the first is not one), and the end of the last one's payload."""
    if cursor + DESCRIPTOR_SIZE > source.size:
        return 0, cursor
    head = np.frombuffer(source.read(cursor, DESCRIPTOR_SIZE), DESCRIPTOR_DTYPE)[0]
    if bytes(head["magic"]) != b"KVCK" or int(head["kind"]) not in TABLE_KINDS:
        return 0, cursor
    size = int(head["stored_size"])
    stride = align(DESCRIPTOR_SIZE + size)
    count = min(_BULK, (source.size - cursor - DESCRIPTOR_SIZE - size) // stride + 1)
    if count < 2 or int(head["offset"]) != cursor:
        return 0, cursor  # not worth predicting: the record-by-record path takes it
    span = np.frombuffer(source.read(cursor, (count - 1) * stride + DESCRIPTOR_SIZE + size), np.uint8)
    starts = np.arange(count) * stride
    # The predicted descriptors as a strided view of the file: nothing is copied until a prefix holds.
    table = np.ndarray((count,), DESCRIPTOR_DTYPE, buffer=span, strides=(stride,))
    cheap = (
        (table["magic"] == b"KVCK")
        & np.isin(table["kind"], TABLE_KINDS)
        & (table["offset"] == cursor + starts)
        & (table["stored_size"] == size)
    )
    taken = count if cheap.all() else int(np.argmin(cheap))  # checksums only for that prefix
    end = (taken - 1) * stride + DESCRIPTOR_SIZE + size
    if taken > 1:  # every descriptor and payload CRC of the prefix in one pass (`records_linear`)
        crcs = np.ascontiguousarray(table["payload_crc"][:taken])
        if linear_crc(span[:end].data) == int(records_linear(crcs, size, stride, DESCRIPTOR_SIZE, False)):
            return taken, cursor + end
    # A CRC in the prefix is wrong (or its padding is not zero): find where, record by record.
    taken = _checked_prefix(span, table, taken, stride, size)
    if taken == 0:
        return 0, cursor
    return taken, cursor + (taken - 1) * stride + DESCRIPTOR_SIZE + size


def _checked_prefix(span: np.ndarray, table: np.ndarray, taken: int, stride: int, size: int) -> int:
    """How many of the first ``taken`` records (every ``stride`` bytes of ``span``, payloads of
    ``size`` bytes) have good descriptor and payload CRCs, from the first."""
    rows = np.ndarray((taken, 60), np.uint8, buffer=span, strides=(stride, 1))
    crc_good = crc32c_rows(np.ascontiguousarray(rows)) == table["descriptor_crc"][:taken]
    if not crc_good.all():
        taken = int(np.argmin(crc_good))
    if taken == 0:
        return 0
    starts = np.arange(taken) * stride
    crcs = crc32c_slices(span.data, (starts + DESCRIPTOR_SIZE).tolist(), [size] * taken)
    crc_good = crcs == table["payload_crc"][:taken]
    return int(np.argmin(crc_good)) if not crc_good.all() else taken


@dataclass(frozen=True)
class _Trailing:
    """The snapshot rebuilt from chunks after the last commit (None: none is added), the position
    it is cut at, and the layers some head of which had reached no further."""

    entry: Entry | None
    end: int
    short_layers: tuple[int, ...]
    rows_left_out: int


def _expected_heads(manifest: Manifest) -> np.ndarray:
    """Every (layer, seq, head) of a present layer, as one int64 key each (`_key`)."""
    keys = [
        (layer, seq, head)
        for layer, spec in enumerate(manifest.layers)
        if spec.present
        for seq in range(manifest.num_seqs)
        for head in range(spec.num_heads)
    ]
    if not keys:
        return np.zeros(0, np.int64)
    array = np.asarray(keys, np.int64)
    return _key(array[:, 0], array[:, 1], array[:, 2])


def _key(layer: np.ndarray, seq: np.ndarray, head: np.ndarray) -> np.ndarray:
    return (layer.astype(np.int64) << 36) | (seq.astype(np.int64) << 16) | head.astype(np.int64)


def _trailing_snapshot(
    blocks: list[bytes], snapshots: list[Entry], committed: int, manifest: Manifest
) -> _Trailing:
    """The snapshot adding the complete K/V runs written after the last committed one, cut at the
    least position every head of every present layer reached, so that no head of it stops short
    of the others (a writer cut off half-way through a step leaves some heads ahead: their extra
    rows are left out). Nothing is added when no head reaches past where it already was."""
    table = np.frombuffer(b"".join(blocks), dtype=DESCRIPTOR_DTYPE)
    tail = table[committed:]
    if snapshots and not bool(np.any(np.isin(tail["kind"], (KIND_K, KIND_V)))):
        return _Trailing(None, 0, (), 0)  # nothing after the last snapshot: the usual crash point
    expected = _expected_heads(manifest).tolist()
    reached = _held_ends(snapshots, table, expected)
    complete = _complete_runs(tail, committed, reached)
    end = min((reached.get(key, 0) for key in expected), default=0)
    short = sorted({key >> 36 for key in expected if reached.get(key, 0) == end})
    short_layers = tuple(short) if end < max(reached.values(), default=0) else ()
    appends, left_out = _cut(complete, end)
    if not appends:
        return _Trailing(None, end, short_layers, left_out)
    parent = len(snapshots) - 1 if snapshots else None
    return _Trailing(Entry(parent, [], appends, {"recovered": True}), end, short_layers, left_out)


def _cut(complete: list[tuple[int, int, int, int]], end: int) -> tuple[list[tuple[int, int, int]], int]:
    """The appends ``(chunk, first row, rows)`` of the complete K/V runs up to position ``end``,
    and how many rows past it were left out."""
    appends: list[tuple[int, int, int]] = []
    left_out = 0
    for k, v, position, rows in complete:
        kept = min(rows, end - position)
        left_out += rows - max(kept, 0)
        if kept > 0:
            appends += [(k, 0, kept), (v, 0, kept)]
    return appends, left_out


def _held_ends(snapshots: list[Entry], table: np.ndarray, expected: list[int]) -> dict[int, int]:
    """Per head key (`_key`) of ``expected``, one past the last position the last committed
    snapshot holds (0 without one)."""
    held_end: dict[int, int] = dict.fromkeys(expected, 0)
    if not snapshots:
        return held_end
    runs = Chain(snapshots, table).runs(len(snapshots) - 1)
    if runs.shape[0]:
        keys = _key(runs[:, LAYER], runs[:, SEQ], runs[:, HEAD])
        ends = runs[:, POSITION] + runs[:, COUNT]
        order = np.lexsort((ends, keys))
        for key, end in zip(keys[order].tolist(), ends[order].tolist(), strict=True):
            held_end[key] = end  # the largest end of each head comes last
    return held_end


def _complete_runs(
    tail: np.ndarray, committed: int, reached: dict[int, int]
) -> list[tuple[int, int, int, int]]:
    """``(K index, V index, position, rows)`` of each K run of ``tail`` (the table after the
    ``committed`` chunks) whose V run followed, continuing its head; ``reached`` (head key ->
    one past its last position) is advanced past each."""
    complete: list[tuple[int, int, int, int]] = []
    pending: dict[tuple[int, int, int, int, int], int] = {}
    columns = [tail[name].tolist() for name in ("kind", "layer", "seq", "head", "position", "rows")]
    for offset, (kind, layer, seq, head, position, rows) in enumerate(zip(*columns, strict=True)):
        run = (layer, seq, head, position, rows)
        if kind == KIND_K:
            pending[run] = committed + offset
        elif run in pending:
            k = pending.pop(run)
            key = (layer << 36) | (seq << 16) | head
            if position >= reached.get(key, 0) and rows:
                complete.append((k, committed + offset, position, rows))
                reached[key] = position + rows
    return complete


def default_output(partial_path: str | os.PathLike[str]) -> str:
    """Where `recover` writes without an output path: ``X.partial`` -> ``X``; any other name
    ``X.ext`` -> ``X.recovered.ext`` (``run.kv`` -> ``run.recovered.kv``)."""
    partial = os.fspath(partial_path)
    if partial.endswith(".partial"):
        return partial[: -len(".partial")]
    stem, ext = os.path.splitext(partial)
    return f"{stem}.recovered{ext or '.kv'}"


def _complete(path: str) -> bool:
    """Whether ``path`` already opens as a complete file (footer, index, every snapshot)."""
    try:
        with reader.open(path) as snap:
            snap._check_snapshots()
    except KVFormatError:
        return False
    return True


def _copy_prefix(source: str, target: str, size: int) -> None:
    """The first ``size`` bytes of ``source`` into the new file ``target`` (in-kernel where the
    system allows: ``copy_file_range``, else a buffered copy)."""
    with open(source, "rb") as src, open(target, "xb") as dst:
        left = size
        copy_range = getattr(os, "copy_file_range", None)
        if copy_range is not None:
            try:
                while left:
                    done = copy_range(
                        src.fileno(), dst.fileno(), min(left, 1 << 30), size - left, size - left
                    )
                    if done <= 0:
                        break
                    left -= done
            except OSError:
                pass  # not across these file systems: the plain copy below finishes it
        src.seek(size - left)
        dst.seek(size - left)
        while left:
            block = src.read(min(left, 16 << 20))
            if not block:
                raise TruncatedFileError(f"{source}: shrank while it was read")
            dst.write(block)
            left -= len(block)


def _finish_complete(partial: str, out: str, overwrite: bool) -> RecoverReport:
    """A ``.partial`` file that is already complete: its writer stopped between the last fsync
    and the rename. A durable copy at ``out`` finishes that step (the input is only read)."""
    size = os.path.getsize(partial)
    with output_path(out, inputs=[partial], force=overwrite) as temporary:
        _copy_prefix(partial, temporary, size)
        with open(temporary, "r+b") as f:
            os.fsync(f.fileno())
        with reader.open(temporary) as snap:
            snap._check_snapshots()
            chunks, snapshots = snap.num_chunks, snap.num_snapshots
    fsync_directory(out)
    return RecoverReport(out, chunks, snapshots, False, 0)


def recover(
    partial_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
    force: bool = False,
) -> RecoverReport:
    """Write a new, valid file holding every complete chunk of ``partial_path`` (a ``.partial``
    file a writer left behind, or any truncated `.kv` file) to ``out_path`` (default:
    `default_output`). The input is only read: it stays byte for byte.

    A complete ``.partial`` (its writer stopped between the last fsync and the rename) is copied
    to the output whole; any other complete, valid input is left alone and nothing is written
    (``RecoverReport.path`` is None). An input a live writer still holds (its lock,
    `kvformat.io.outputs.in_use`) is refused unless ``force`` (what a live writer has written so far
    is then recovered). An existing output is refused unless ``overwrite``; the output is never
    the input.
    """
    partial = os.fspath(partial_path)
    out = _checked_paths(partial, out_path, overwrite, force)
    if _complete(partial):
        if partial.endswith(".partial"):
            return _finish_complete(partial, out, overwrite)
        return RecoverReport(None, 0, 0, False, 0)
    source = MmapSource(partial)
    try:
        good_end, manifest, blocks, snapshots, committed = _scan(source)
        size = source.size
    finally:
        source.close()
    trailing = _trailing_snapshot(blocks, snapshots, committed, manifest)
    if trailing.entry is not None:
        snapshots.append(trailing.entry)
    if not snapshots:
        raise IncompleteRecoveryError(
            f"{partial}: no snapshot is complete: the writer stopped before every head of its first "
            f"snapshot was written ({_short(trailing.short_layers, manifest)} reached position "
            f"{trailing.end}); nothing to recover"
        )
    _write_recovered(partial, out, overwrite, good_end, (blocks, manifest, snapshots))
    chunks = sum(len(block) for block in blocks) // DESCRIPTOR_SIZE
    return RecoverReport(
        out,
        chunks,
        len(snapshots),
        trailing.entry is not None,
        max(size - good_end, 0),
        trailing.rows_left_out,
        trailing.end if trailing.rows_left_out else None,
        trailing.short_layers,
    )


def _checked_paths(
    partial: str, out_path: str | os.PathLike[str] | None, overwrite: bool, force: bool
) -> str:
    """`recover`'s output path, once the input and the output are found fit: the input is not a
    capture that finished under another name, the output is not the input nor (without
    ``overwrite``) an existing file, and no live writer holds the input (without ``force``)."""
    finished = partial.removesuffix(".partial")
    if partial != finished and not os.path.lexists(partial) and os.path.isfile(finished):
        raise FileNotFoundError(
            errno.ENOENT,
            f"{partial} does not exist: the capture finished as {finished}, nothing to recover "
            f"(kvsnap verify {finished} checks it)",
        )
    out = os.fspath(out_path) if out_path is not None else default_output(partial)
    check_output(out, inputs=[partial], force=overwrite)
    if not force and in_use(partial):
        raise FileInUseError(
            f"{partial} is being written by a live process (it holds the file's lock); wait for it to "
            "finish, or pass --force (force=True from Python) to recover what it has written so far"
        )
    return out


def _write_recovered(
    partial: str, out: str, overwrite: bool, good_end: int, found: tuple[list[bytes], Manifest, list[Entry]]
) -> None:
    """Write ``out``: ``partial``'s first ``good_end`` bytes, then an index of ``found`` (the
    table blocks, the manifest and the snapshots kept), through a temporary file that is read
    back (every snapshot materializes) before it takes the output's name."""
    blocks, manifest, snapshots = found
    index_offset = align(good_end)
    with output_path(out, inputs=[partial], force=overwrite) as temporary:
        _copy_prefix(partial, temporary, good_end)
        with open(temporary, "r+b") as f:
            f.seek(good_end)
            f.write(bytes(index_offset - good_end))
            f.write(index_bytes(index_offset, blocks, manifest, snapshots))
            f.flush()
            os.fsync(f.fileno())
        with reader.open(temporary) as snap:
            snap._check_snapshots()  # every snapshot materializes (each entry checked once)
    fsync_directory(out)


def _short(layers: tuple[int, ...], manifest: Manifest) -> str:
    """ "layers 18-31" for the layers whose heads stopped short (all present layers if none)."""
    if not layers:
        layers = tuple(i for i, spec in enumerate(manifest.layers) if spec.present)
    return "layer " + str(layers[0]) if len(layers) == 1 else "layers " + _ranges(layers)


def _ranges(values: tuple[int, ...]) -> str:
    """ "0-3, 7, 9-10" for sorted distinct integers."""
    parts: list[str] = []
    start = prev = values[0]
    for value in (*values[1:], None):
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ", ".join(parts)
