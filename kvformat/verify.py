"""Verifying a whole file (`Snapshot.verify`): every record from offset 64 to the index, every
CRC, padding byte and snapshot reference, in bulk where records lie back to back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvformat import codecs
from kvformat.checksum import (
    concatenated_linear,
    crc32c,
    crc32c_many,
    crc32c_rows,
    crc32c_slices,
    linear_crc,
    records_linear,
    repeated_linear,
    self_checked_linear,
)
from kvformat.errors import CorruptFileError, KVFormatError
from kvformat.io.source import MmapSource
from kvformat.layout import (
    ALIGN,
    DESCRIPTOR_DTYPE,
    DESCRIPTOR_MAGIC,
    DESCRIPTOR_SIZE,
    HEADER_SIZE,
    JSON_KINDS,
    KIND_MANIFEST,
    KIND_SELECTION,
    KIND_SNAPSHOT,
    LAST_STRICT_MINOR,
    MINOR,
    TABLE_KINDS,
    Descriptor,
    align,
)
from kvformat.manifest import loads
from kvformat.queries import check_all_queries, check_selection_rows
from kvformat.runs import ranges
from kvformat.structure import FileStructure, check_arrays, chunk_label, payload_crc_mismatch


@dataclass(frozen=True)
class VerifyReport:
    """What `Snapshot.verify` checked: records, tensor chunks, bytes covered by CRCs."""

    records: int
    chunks: int
    snapshots: int
    bytes_checked: int


_VERIFY_BATCH_BYTES = 64 << 20  # records checked together in bulk: at most this many bytes


def verify(file: FileStructure) -> VerifyReport:
    """Walk the record stream from offset 64 to the index, checking everything.

    A file whose chunks all lie in runs of equal raw records (a series) is checked in one CRC
    pass over the whole stream (`_StreamChecksum`, `_check_all_but_the_stream`). Otherwise, and
    whenever that pass finds a problem, runs of table chunks laid back to back are checked in
    bulk (`_verify_chunks`: descriptors against the chunk table, descriptor and payload CRCs,
    padding), the JSON records between them one by one (`_verify_record`); whatever fails in
    bulk is checked again one by one, so the error names the record exactly as the one-by-one
    walk would."""
    runs = _Runs(file.table)
    report, batches = _verify_in_one_pass(file, runs)
    if report is not None:
        return report
    passed, snapshot_error = _check_batches(file, batches, runs.offsets)
    records, chunk, checked = _walk(file, runs, passed)
    if chunk != runs.n:
        raise CorruptFileError(f"index lists {runs.n} chunks, the file holds {chunk}")
    if snapshot_error is not None:
        raise snapshot_error
    for i, entry in enumerate(file.entries):
        check_arrays(file, i, entry.arrays)
    _check_queries_and_selections(file)
    return VerifyReport(records, chunk, len(file.entries), checked)


def _check_queries_and_selections(file: FileStructure) -> None:
    """Every snapshot's queries (`check_all_queries`) and every selection chunk's rows (1.7:
    key positions in increasing order)."""
    check_all_queries(file)
    for i in np.flatnonzero(file.table["kind"] == KIND_SELECTION).tolist():
        check_selection_rows(file.chunk_array(i, checked=True), file.chunk_name(i))
        file.checked_selections.add(i)  # a later read of it need not check its rows again


class _Runs:
    """The chunk table's records as runs of back-to-back chunks (chunk i+1 starts where chunk i's
    record ends): ``offsets``, ``follows`` (where each record's padding ends), and per run its
    ``firsts`` and ``lasts`` chunk."""

    def __init__(self, table: np.ndarray) -> None:
        self.n = n = len(table)
        self.offsets = table["offset"].astype(np.int64)
        self.stored = table["stored_size"].astype(np.int64)
        follows = self.offsets + self.stored
        follows += DESCRIPTOR_SIZE + ALIGN - 1
        follows &= -ALIGN
        self.follows = follows
        breaks = np.flatnonzero(follows[:-1] != self.offsets[1:]) if n > 1 else np.empty(0, np.int64)
        self.firsts = np.concatenate(([0], breaks + 1)) if n else np.empty(0, np.int64)
        self.lasts = np.append(breaks, n - 1) if n else np.empty(0, np.int64)


def _verify_in_one_pass(file: FileStructure, runs: _Runs) -> tuple[VerifyReport | None, list[_Batch]]:
    """The one-CRC-pass check of a file whose chunks all lie in runs of equal records: its report
    when everything holds, else None (and the equal-record batches, for the bulk checks)."""
    stream = _StreamChecksum(file)
    one_pass: tuple[int, int, int] | None = None
    # A memory map is checksummed from the start (a series is verified in this one pass); a
    # remote or file-object source only once the file is known to be a series (nothing read
    # twice).
    eager = isinstance(file.source, MmapSource)
    with ThreadPoolExecutor(1, thread_name_prefix="kvformat-verify") as pool:
        helper = pool.submit(stream.run) if eager else None
        try:
            batches = _equal_run_batches(
                file, runs.firsts, runs.lasts + 1, runs.offsets, runs.stored, runs.follows
            )
            if sum(b.count for b in batches) == runs.n:  # every chunk in a run of equal records
                stream.compare(runs.offsets)
                if helper is None:
                    helper = pool.submit(stream.run)
                one_pass = _check_all_but_the_stream(
                    file, batches, runs.offsets, runs.follows[runs.lasts], runs.offsets[runs.firsts]
                )
        finally:
            if one_pass is None:
                stream.stop()
            stream.run()
            if helper is not None:
                helper.result()
    if one_pass is None:
        return None, batches
    return _one_pass_report(file, runs, batches, one_pass, stream.result()), batches


def _one_pass_report(
    file: FileStructure,
    runs: _Runs,
    batches: list[_Batch],
    one_pass: tuple[int, int, int],
    stream_crc: int | None,
) -> VerifyReport | None:
    """The report of a one-pass check whose runs all held: None where the streamed checksum or
    the padding between records does not; every snapshot's arrays and queries checked."""
    between, nbytes, expected_crc = one_pass
    if stream_crc != expected_crc or not _zero_padding(file, batches, runs.offsets):
        return None
    for i, entry in enumerate(file.entries):
        check_arrays(file, i, entry.arrays)
    _check_queries_and_selections(file)
    chunk_bytes = sum(b.count * (DESCRIPTOR_SIZE + b.size) for b in batches)
    return VerifyReport(between + runs.n, runs.n, len(file.entries), nbytes + chunk_bytes)


def _check_batches(
    file: FileStructure, batches: list[_Batch], offsets: np.ndarray
) -> tuple[dict[int, tuple[int, int]], KVFormatError | None]:
    """The bulk checks of equal runs: ``{first chunk: (stop, bytes)}`` of the batches that hold,
    and the snapshots' error (raised after the walk, so the first problem in file order is the
    one reported). The CRC pass (mostly one call without the GIL) starts on a helper thread
    while this one builds the expected CRCs and checks the snapshots, then takes a share of the
    batches left."""
    results: list[tuple[int, bool]] = [(0, False)] * len(batches)
    todo = iter(range(len(batches)))  # shared by both threads: next() is atomic
    with ThreadPoolExecutor(1, thread_name_prefix="kvformat-verify") as pool:
        helper = pool.submit(_checksum_batches, file, batches, offsets, todo, results)
        expected = _expected_crcs(file, batches)
        table_holds = _table_self_checked(file)
        try:
            file.chain.check_all()  # every snapshot, each entry once
            snapshot_error: KVFormatError | None = None
        except KVFormatError as exc:
            snapshot_error = exc
        _checksum_batches(file, batches, offsets, todo, results)
        helper.result()
    passed = {
        b.first: (b.first + b.count, b.count * (DESCRIPTOR_SIZE + b.size))
        for b, want, (crc, same) in zip(batches, expected, results, strict=True)
        if same and crc == want and table_holds
    }
    return passed, snapshot_error


def _walk(file: FileStructure, runs: _Runs, passed: dict[int, tuple[int, int]]) -> tuple[int, int, int]:
    """Walk the record stream: runs of table chunks in bulk (those in ``passed`` already checked),
    the records between them one by one. Returns ``(records, chunks, bytes checked)``."""
    cursor, records, chunk, checked = HEADER_SIZE, 0, 0, 0
    while cursor < file.footer.index_offset:
        if records and chunk < runs.n and int(runs.offsets[chunk]) == cursor:
            last = int(runs.lasts[np.searchsorted(runs.lasts, chunk)])
            while chunk <= last:  # in batches of bounded size
                stop, size, end = _run_batch(file, runs, passed, chunk, last, cursor, records)
                checked += size
                records += stop - chunk
                chunk, cursor = stop, end
            continue
        cursor, chunk, size = _verify_record(file, cursor, records, chunk)
        checked += size
        records += 1
    return records, chunk, checked


def _run_batch(
    file: FileStructure,
    runs: _Runs,
    passed: dict[int, tuple[int, int]],
    chunk: int,
    last: int,
    cursor: int,
    records: int,
) -> tuple[int, int, int]:
    """Check the chunks from ``chunk`` on (at most `_VERIFY_BATCH_BYTES`, within the run ending at
    ``last``): ``(stop, bytes, end offset)``. A batch that fails in bulk is walked one by one,
    which raises the error naming the record."""
    done = passed.get(chunk)
    if done is not None:  # checked already, with equal neighbours
        stop, size = done
        return stop, size, int(runs.follows[stop - 1])
    stop = int(np.searchsorted(runs.offsets, runs.offsets[chunk] + _VERIFY_BATCH_BYTES, side="left"))
    stop = min(max(stop, chunk + 1), last + 1)
    size, end = _verify_chunks(file, chunk, stop, int(runs.follows[stop - 1]))
    if end < 0:  # something is wrong in this batch: walk it one by one for the error
        for step in range(chunk, stop):
            cursor, _, _ = _verify_record(file, cursor, records + step - chunk, step)
        raise AssertionError("a batch failed in bulk but passed record by record")
    return stop, size, end


@dataclass(frozen=True)
class _Batch:
    """Chunks ``first .. first+count-1``: back-to-back raw records of ``stride`` bytes, each a
    payload of ``size`` bytes."""

    first: int
    count: int
    stride: int
    size: int


def _equal_run_batches(
    file: FileStructure,
    firsts: np.ndarray,
    stops: np.ndarray,
    offsets: np.ndarray,
    stored: np.ndarray,
    follows: np.ndarray,
) -> list[_Batch]:
    """Runs of back-to-back raw chunks whose payloads all have one size (a series' snapshots
    append such runs), cut into batches of at most `_VERIFY_BATCH_BYTES`."""
    table = file.table
    n = len(table)
    if n == 0:
        return []
    # Records that differ from the one before in payload size, and records not raw: a run keeps
    # none of the first after its own first record, and none of the second.
    resized = np.flatnonzero(stored[1:] != stored[:-1]) + 1
    encoded = np.flatnonzero(table["codec"] != codecs.Raw.code)
    keep = np.searchsorted(resized, firsts, side="right") == np.searchsorted(resized, stops)
    keep &= np.searchsorted(encoded, firsts) == np.searchsorted(encoded, stops)
    keep &= follows[stops - 1] <= file.footer.index_offset  # the last padding before the index
    firsts, stops = firsts[keep], stops[keep]
    if not firsts.size:
        return []
    per_batch = np.maximum(1, _VERIFY_BATCH_BYTES // (follows[firsts] - offsets[firsts]))
    batches_of_run = -(-(stops - firsts) // per_batch)
    step = np.repeat(per_batch, batches_of_run)
    starts = np.repeat(firsts, batches_of_run) + ranges(np.zeros_like(firsts), batches_of_run) * step
    counts = np.minimum(step, np.repeat(stops, batches_of_run) - starts)
    return [
        _Batch(f, c, align(DESCRIPTOR_SIZE + p), p)
        for f, c, p in zip(starts.tolist(), counts.tolist(), stored[starts].tolist(), strict=True)
    ]


def _expected_crcs(file: FileStructure, batches: list[_Batch]) -> list[int]:
    """Per batch, the linear part of the CRC-32C its bytes have if every descriptor's and
    payload's CRC holds and every padding byte is zero (`kvformat.checksum.records_linear`): a
    few table lookups per record, from the chunk table alone, batches of one shape together."""
    expected = [0] * len(batches)
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, b in enumerate(batches):
        shapes.setdefault((b.count, b.size), []).append(i)
    for (count, size), members in shapes.items():
        firsts = np.array([batches[i].first for i in members], np.int64)
        if bool(np.all(np.diff(firsts) == count)):  # one after the other: a view, not a gather
            crcs = file.table["payload_crc"][firsts[0] : firsts[-1] + count].reshape(-1, count)
        else:
            crcs = file.table["payload_crc"][firsts[:, None] + np.arange(count)]
        values = records_linear(crcs, size, align(DESCRIPTOR_SIZE + size), DESCRIPTOR_SIZE).tolist()
        for i, value in zip(members, values, strict=True):
            expected[i] = value
    return expected


def _checksum_batches(
    file: FileStructure,
    batches: list[_Batch],
    offsets: np.ndarray,
    todo: Iterator[int],
    results: list[tuple[int, bool]],
) -> None:
    """For the batches taken from ``todo`` (more than one thread may share it): one CRC-32C pass
    over each one's bytes (the linear part), and whether each descriptor's CRC field equals its
    index copy's and its padding is zero (checked directly: the CRC would miss padding that
    happens to be a multiple of the polynomial), into ``results[i]``. With the batch's CRC
    (every descriptor self-checked, `_expected_crcs`) and the table's (`_table_self_checked`),
    equal CRC fields show each descriptor equal to its index copy (SPEC section 18). A batch
    that fails any of it is left to `_verify_chunks`, which also names what is wrong."""
    copies = file.table["descriptor_crc"]
    for i in todo:
        b = batches[i]
        span = file.source.read(int(offsets[b.first]), b.count * b.stride)
        crc = linear_crc(span)
        # Each descriptor's own CRC holds if the batch's CRC does (`_expected_crcs`), so it
        # equals its index copy if their CRC fields are equal: SPEC section 18.
        own = np.ndarray((b.count,), np.uint32, buffer=span, offset=DESCRIPTOR_SIZE - 4, strides=(b.stride,))
        good = np.array_equal(own, copies[b.first : b.first + b.count])
        padding = b.stride - DESCRIPTOR_SIZE - b.size
        if good and padding:
            start = DESCRIPTOR_SIZE + b.size
            pads = np.ndarray((b.count, padding), np.uint8, buffer=span, offset=start, strides=(b.stride, 1))
            good = not pads.any()
        results[i] = (crc, bool(good))


def _table_self_checked(file: FileStructure) -> bool:
    """Whether every descriptor of the chunk table ends with the CRC-32C of its first 60 bytes,
    from one CRC pass over the table (`kvformat.checksum.repeated_linear`)."""
    n = len(file.table)
    table = file.source.read(file.footer.index_offset, n * DESCRIPTOR_SIZE)
    return linear_crc(table) == repeated_linear(self_checked_linear(DESCRIPTOR_SIZE), DESCRIPTOR_SIZE, n)


_SEGMENT_BYTES = 8 << 20  # the one pass checksums the record stream in pieces of this size


class _StreamChecksum:
    """One CRC-32C pass over the record stream, ``[64, index_offset)``, for a series: pieces of
    `_SEGMENT_BYTES` taken in turn by every thread that calls `run` (long C calls: the GIL is
    rarely needed). Once `compare` has said where the descriptors lie, each piece also compares
    its descriptors' CRC fields with their index copies while its bytes are at hand: each
    descriptor's own CRC holds if the stream's CRC is what `_check_all_but_the_stream` expects,
    so equal CRC fields show it equal to its index copy (SPEC section 18)."""

    def __init__(self, file: FileStructure) -> None:
        self._file = file
        self._end = end = file.footer.index_offset
        self._pieces = [
            (a, min(a + _SEGMENT_BYTES, end) - a) for a in range(HEADER_SIZE, end, _SEGMENT_BYTES)
        ]
        self._parts = [0] * len(self._pieces)
        self._compared = [False] * len(self._pieces)
        self._same = [True] * len(self._pieces)
        self._todo = iter(range(len(self._pieces)))  # shared by the threads: next() is atomic
        self._offsets: np.ndarray | None = None
        self._cuts: list[int] | None = None

    def compare(self, offsets: np.ndarray) -> None:
        """Compare descriptor CRC fields from now on; ``offsets``: every chunk's, ascending."""
        self._offsets = offsets
        self._cuts = np.searchsorted(offsets, [a for a, _ in self._pieces] + [self._end]).tolist()

    def run(self) -> None:
        for i in self._todo:
            span = self._file.source.read(*self._pieces[i])
            self._parts[i] = linear_crc(span)
            if self._cuts is not None:
                self._compare(i, span)

    def stop(self) -> None:
        """Leave the pieces no thread has taken yet."""
        for _ in self._todo:
            pass

    def _compare(self, i: int, span: memoryview) -> None:
        assert self._offsets is not None and self._cuts is not None
        first, stop = self._cuts[i], self._cuts[i + 1]
        words = np.frombuffer(span, np.uint32)  # pieces and records are 64-aligned
        fields = (self._offsets[first:stop] - (self._pieces[i][0] - DESCRIPTOR_SIZE + 4)) >> 2
        self._same[i] = np.array_equal(words[fields], self._file.table["descriptor_crc"][first:stop])
        self._compared[i] = True

    def result(self) -> int | None:
        """Once every `run` has returned: the stream's linear CRC, or None if a descriptor's CRC
        field differs from its index copy's."""
        for i, done in enumerate(self._compared):
            if not done:  # checksummed before `compare`
                self._compare(i, self._file.source.read(*self._pieces[i]))
        if not all(self._same):
            return None
        return concatenated_linear(
            (size, part) for (_, size), part in zip(self._pieces, self._parts, strict=True)
        )


def _check_all_but_the_stream(
    file: FileStructure,
    batches: list[_Batch],
    offsets: np.ndarray,
    run_ends: np.ndarray,
    run_starts: np.ndarray,
) -> tuple[int, int, int] | None:
    """For a file whose every chunk lies in a batch of equal raw records (`_equal_run_batches`),
    what `_StreamChecksum` does not check: the chunk table's own CRCs, the snapshots, the records
    between the runs one by one (``run_ends[i]`` to ``run_starts[i + 1]``). Returns those
    records, their bytes, and the linear CRC the stream must have (each run's from the chunk
    table, each stretch between runs from its bytes); None if anything fails: the walk in file
    order then names the problem."""
    if not _table_self_checked(file):
        return None
    try:
        file.chain.check_all()
    except KVFormatError:
        return None
    between = _walk_between(file, run_ends, run_starts)
    if between is None:
        return None
    records, nbytes, gaps = between
    # The pieces in file order: the records before the first run, then each run's batches and
    # the records after it.
    expected = _expected_crcs(file, batches)
    pieces = [gaps[0]]
    ends = run_ends.tolist()
    run = 0
    for b, start, part in zip(batches, offsets[[b.first for b in batches]].tolist(), expected, strict=True):
        pieces.append((b.count * b.stride, part))
        if start + b.count * b.stride == ends[run]:  # the run's last batch: then what follows it
            run += 1
            pieces.append(gaps[run])
    if run != len(ends):
        return None
    return records, nbytes, concatenated_linear(pieces)


def _zero_padding(file: FileStructure, batches: list[_Batch], offsets: np.ndarray) -> bool:
    """Whether the padding of every record of ``batches`` is zero, checked directly: the CRC
    would miss padding that is a multiple of the polynomial."""
    for b in batches:
        padding = b.stride - DESCRIPTOR_SIZE - b.size
        if padding:
            start = int(offsets[b.first]) + DESCRIPTOR_SIZE + b.size
            span = file.source.read(start, (b.count - 1) * b.stride + padding)
            if np.ndarray((b.count, padding), np.uint8, buffer=span, strides=(b.stride, 1)).any():
                return False
    return True


def _walk_between(
    file: FileStructure, starts: np.ndarray, stops: np.ndarray
) -> tuple[int, int, list[tuple[int, int]]] | None:
    """Check the records between runs of chunks: from offset 64 to the first run, from the end
    of each run (``starts``, one per run) to the next one (``stops``, one per run), from the last
    to the index. A stretch holding exactly one JSON record (a series' snapshot records) is
    checked with the others in bulk (`_single_records_hold`), any other one record by record
    (`_verify_record`). Returns the records, their bytes, and each stretch's ``(bytes, linear
    CRC)``; None if any check fails or a record is a chunk (the walk in file order names it)."""
    index_offset = file.footer.index_offset
    n = len(file.table)
    lower = np.concatenate(([HEADER_SIZE], starts)).astype(np.int64)
    upper = np.concatenate((stops, [index_offset])).astype(np.int64)
    if lower[0] == upper[0]:  # a chunk first: not the manifest
        return None
    single = _single_records_hold(file, lower, upper)
    if single is None:
        return None
    records, checked = int(np.count_nonzero(single[0])), int(single[1].sum())
    try:
        for gap in np.flatnonzero(~single[0]).tolist():
            cursor, stop = int(lower[gap]), int(upper[gap])
            while cursor < stop:
                # Only whether a record is the first one matters to `_verify_record`.
                cursor, chunk, size = _verify_record(file, cursor, int(cursor != HEADER_SIZE), n)
                records += 1
                checked += size
                if chunk != n:
                    return None
            if cursor != stop:
                return None
    except KVFormatError:
        return None
    read = file.source.read
    gaps = [(b - a, linear_crc(read(a, b - a))) for a, b in zip(lower.tolist(), upper.tolist(), strict=True)]
    return records, checked, gaps


def _single_records_hold(
    file: FileStructure, lower: np.ndarray, upper: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """Of the stretches ``[lower[i], upper[i])`` (the first at offset 64), which hold exactly one
    JSON record (a descriptor there whose record, padded, ends at ``upper[i]``), and those
    records' bytes. Each such record is checked in bulk as `_verify_record` checks it (magic,
    descriptor CRC, offset, payload CRC, JSON, manifest first and only there, zero padding);
    None if one fails. Other stretches are left to `_verify_record`."""
    size = np.zeros(lower.shape[0], np.int64)
    room = upper - lower >= DESCRIPTOR_SIZE
    if not room.any():
        return room, size
    read = file.source.read  # record by record: a remote or file-object source reads no more
    at = lower[room]
    raw = np.frombuffer(b"".join([read(a, DESCRIPTOR_SIZE) for a in at.tolist()]), np.uint8)
    raw = raw.reshape(-1, DESCRIPTOR_SIZE)
    fields = raw.view(DESCRIPTOR_DTYPE).reshape(-1)
    end = at + DESCRIPTOR_SIZE + fields["stored_size"].astype(np.int64)
    kinds = fields["kind"]
    # One JSON record that ends the stretch, with its own descriptor: the rest is checked below
    # (anything else goes the record-by-record way, which names what is wrong).
    one = (
        (fields["magic"] == DESCRIPTOR_MAGIC)
        & (fields["offset"].astype(np.int64) == at)
        & ((end + ALIGN - 1) & -ALIGN == upper[room])
        & ((kinds == KIND_MANIFEST) | (kinds == KIND_SNAPSHOT))
        & (fields["dtype"] == 0)
        & (fields["codec"] == 0)
        & (fields["flags"] == 0)
        & (fields["decoded_size"] == fields["stored_size"])
    )
    one &= crc32c_rows(np.ascontiguousarray(raw[:, :60])) == fields["descriptor_crc"]
    single = np.zeros(lower.shape[0], bool)
    single[np.flatnonzero(room)[one]] = True
    at, end, fields = at[one], end[one], fields[one]
    if bool(np.any((fields["kind"] == KIND_MANIFEST) != (at == HEADER_SIZE))):
        return None  # the manifest must be the first record, and only it
    if not _json_payloads_hold(read, at, end, fields["payload_crc"]):
        return None
    pads = upper[single] - end
    if any(any(read(a, n)) for a, n in zip(end.tolist(), pads.tolist(), strict=True) if n):
        return None
    size[single] = end - at
    return single, size


def _json_payloads_hold(
    read: Callable[[int, int], memoryview], at: np.ndarray, end: np.ndarray, crcs: np.ndarray
) -> bool:
    """The JSON records at offsets ``at`` (payloads up to ``end``) match their CRCs and parse."""
    stored = (end - at - DESCRIPTOR_SIZE).tolist()
    payloads = [read(a + DESCRIPTOR_SIZE, length) for a, length in zip(at.tolist(), stored, strict=True)]
    if not np.array_equal(crc32c_many(payloads), crcs):
        return False
    try:
        for a, payload in zip(at.tolist(), payloads, strict=True):
            loads(payload, f"record at offset {a}")
    except KVFormatError:
        return False
    return True


def _verify_chunks(file: FileStructure, first: int, stop: int, follows: int) -> tuple[int, int]:
    """Check table chunks ``first .. stop-1``, laid back to back, in bulk. Returns the bytes of
    their records and the offset after the last one's padding, or ``(0, -1)`` if any check fails."""
    table = file.table[first:stop]
    index_offset = file.footer.index_offset
    base = int(table["offset"][0])
    end = min(follows, index_offset)
    span = np.frombuffer(file.source.read(base, end - base), dtype=np.uint8)
    starts = table["offset"].astype(np.int64) - base
    if not _descriptors_hold(span, starts, table):
        return 0, -1
    stored = table["stored_size"].astype(np.int64)
    crcs = crc32c_slices(span.data, (starts + DESCRIPTOR_SIZE).tolist(), stored.tolist())
    if not np.array_equal(crcs, table["payload_crc"]):
        return 0, -1
    # Padding: from each payload's end to the next record (or the index), all zero.
    ends = starts + DESCRIPTOR_SIZE + stored
    lengths = np.append(starts[1:], end - base) - ends
    if lengths.sum():
        where = np.repeat(ends - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        if span[where].any():
            return 0, -1
    encoded = np.flatnonzero(table["codec"] != codecs.Raw.code)
    if encoded.size:  # decoding is the check of an encoded payload (raw ones are sized already)
        try:
            for i in encoded.tolist():
                file.chunk_array(first + i, checked=True)
        except KVFormatError:
            return 0, -1
    return int((DESCRIPTOR_SIZE + stored).sum()), end


def _descriptors_hold(span: np.ndarray, starts: np.ndarray, table: np.ndarray) -> bool:
    """The descriptors at offsets ``starts`` of ``span`` equal the index's ``table`` rows and carry
    their own CRCs."""
    stride = int(starts[1]) if len(starts) > 1 else DESCRIPTOR_SIZE
    if bool(np.all(starts == np.arange(len(starts)) * stride)):  # equal records: a strided view
        descriptors = np.ndarray((len(starts), DESCRIPTOR_SIZE), np.uint8, buffer=span, strides=(stride, 1))
    else:
        descriptors = span[starts[:, None] + np.arange(DESCRIPTOR_SIZE)]
    if not np.array_equal(descriptors, table.view(np.uint8).reshape(-1, DESCRIPTOR_SIZE)):
        return False
    return np.array_equal(crc32c_rows(np.ascontiguousarray(descriptors[:, :60])), table["descriptor_crc"])


def _descriptor_at(file: FileStructure, cursor: int) -> tuple[memoryview | bytes, Descriptor]:
    """The raw bytes and the descriptor of the record at ``cursor``: inside the records, where it
    says it lies, its payload before the index."""
    index_offset = file.footer.index_offset
    if cursor + DESCRIPTOR_SIZE > index_offset:
        raise CorruptFileError(f"record at {cursor} overruns the index")
    raw = file.source.read(cursor, DESCRIPTOR_SIZE)
    try:
        desc = Descriptor.unpack(raw)
    except KVFormatError as exc:
        raise type(exc)(f"{file.source.name}: record at offset {cursor}: {exc}") from None
    if desc.offset != cursor:
        raise CorruptFileError(f"record at {cursor} says it lies at {desc.offset}")
    if desc.end > index_offset:
        raise CorruptFileError(f"record at {cursor} runs into the index")
    return raw, desc


def _check_other_record(
    file: FileStructure, desc: Descriptor, payload: memoryview | bytes, label: str
) -> None:
    """A record that is not a table chunk: a JSON record's fields and text, or a kind unknown
    to this version refused (a newer minor's is skipped)."""
    if desc.kind in JSON_KINDS:
        if desc.dtype or desc.codec or desc.flags or desc.decoded_size != desc.stored_size:
            raise CorruptFileError(
                f"{label}: a JSON record's dtype, codec and flags must be 0 and its decoded size "
                "its stored size"
            )
        loads(payload, label)
    elif file.version[1] <= min(MINOR, LAST_STRICT_MINOR):
        # From 1.7 a record kind that matters comes with the required feature that defines it
        # (which refuses the file before any record is read), so an unknown one is ignored.
        raise CorruptFileError(f"{label}: unknown record kind {desc.kind}")


def _verify_record(file: FileStructure, cursor: int, records: int, chunk: int) -> tuple[int, int, int]:
    """Check the one record at ``cursor`` (the ``records``-th; ``chunk`` table chunks before it).
    Returns the next record's offset, the chunks seen, and this record's bytes."""
    source = file.source
    index_offset = file.footer.index_offset
    raw, desc = _descriptor_at(file, cursor)
    payload = source.read(desc.payload_offset, desc.stored_size)
    label = f"record at offset {cursor}"
    if desc.kind in TABLE_KINDS:
        if chunk >= len(file.table) or bytes(raw) != file.table[chunk].tobytes():
            raise CorruptFileError(f"{label}: chunk {chunk} differs from its index copy")
        label = chunk_label(file.table, chunk)
    if crc32c(payload) != desc.payload_crc:
        raise payload_crc_mismatch(f"{source.name}: {label}")
    if desc.kind in TABLE_KINDS:
        file.chunk_array(chunk, checked=True)
        chunk += 1
    else:
        _check_other_record(file, desc, payload, label)
    if (records == 0) != (desc.kind == KIND_MANIFEST):
        raise CorruptFileError(f"{label}: the manifest must be the first record, and only it")
    next_record = align(desc.end)
    padding = source.read(desc.end, min(next_record, index_offset) - desc.end)
    if any(padding):
        raise CorruptFileError(f"{label}: non-zero padding after the payload")
    return next_record, chunk, DESCRIPTOR_SIZE + desc.stored_size
