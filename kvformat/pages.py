"""Page management for a pass over a whole `.kv` file (`of(snapshot)`, one per open snapshot): segments
read in batches, CRCs left to a caller that reads every byte anyway, pages of chunks released
once a pass is past them and announced before it reaches them (remote sources). A user reading
heads does not need it: `Snapshot.head`, `heads` and `blocks` do this themselves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat import codecs
from kvformat.errors import InvalidArgumentError
from kvformat.layout import DESCRIPTOR_SIZE
from kvformat.runs import Segment, ranges
from kvformat.structure import FileStructure, payload_crc_mismatch

_PAGE = 4096  # chunks this close are released as one range


@dataclass(frozen=True)
class PayloadCheck:
    """The CRC-32C a chunk's payload must have (`Pages.read_unchecked`), and the chunk's
    name for the error."""

    crc: int
    label: str

    def check(self, crc: int) -> None:
        """Raise `ChecksumError` unless ``crc`` (of the payload's bytes) is the expected one."""
        if crc != self.crc:
            raise payload_crc_mismatch(self.label)


@dataclass(frozen=True)
class Head:
    """K and V of one KV head of one layer for one sequence, in temporal order.

    ``k``: ``(n_tokens, k_dim)``, ``v``: ``(n_tokens, v_dim)`` in the layer's dtype (bfloat16 as
    ``ml_dtypes.bfloat16``); ``positions``: ``(n_tokens,)`` int64 absolute token positions.
    """

    layer: int
    head: int
    seq: int
    k: np.ndarray
    v: np.ndarray
    positions: np.ndarray


class Pages:
    """The segments and pages of one open file (shared by its snapshots). Thread-safe reads."""

    def __init__(self, file: FileStructure) -> None:
        self.file = file

    def read(self, segment: Segment) -> Head:
        """One segment as a `Head` (see `Snapshot.read`)."""
        file = self.file
        return Head(
            segment.layer,
            segment.head,
            segment.seq,
            file.chunk_array(segment.k_chunk)[segment.k_row : segment.k_row + segment.count],
            file.chunk_array(segment.v_chunk)[segment.v_row : segment.v_row + segment.count],
            np.arange(segment.position, segment.position + segment.count, dtype=np.int64),
        )

    def read_unchecked(self, segment: Segment) -> tuple[Head, PayloadCheck | None, PayloadCheck | None]:
        """`read`, leaving to the caller the CRCs of the chunks whose whole payload is K or V as
        returned (raw chunks the segment covers entirely): a caller that goes over every byte
        anyway (a copy to a device) checks them there, with `PayloadCheck.check`. Returns the
        `Head` and K's and V's checks, None for a chunk checked here (as `read` does) or in a
        file opened without checks."""
        file = self.file
        checks: list[PayloadCheck | None] = []
        arrays = []
        for chunk, row in ((segment.k_chunk, segment.k_row), (segment.v_chunk, segment.v_row)):
            c = file.chunk(chunk)
            whole = row == 0 and segment.count == c.rows and c.codec == codecs.Raw.code
            if not (whole and file.check_checksums and file.manifest.layers[c.layer].quantization is None):
                arrays.append(file.chunk_array(chunk)[row : row + segment.count])
                checks.append(None)
                continue
            arrays.append(file.chunk_array(chunk, checked=True))
            checks.append(PayloadCheck(c.payload_crc, file.chunk_name(chunk)))
        positions = np.arange(segment.position, segment.position + segment.count, dtype=np.int64)
        head = Head(segment.layer, segment.head, segment.seq, arrays[0], arrays[1], positions)
        return head, checks[0], checks[1]

    def read_many(self, segments: Sequence[Segment]) -> Head:
        """Consecutive segments of one head (as `segments()` gives them) as one `Head`, their rows
        concatenated (one copy): what ``read`` gives for each, joined, at a fraction of the cost
        per segment where segments are many and small (a series of snapshots)."""
        first = segments[0]
        if len({(s.layer, s.seq, s.head) for s in segments}) != 1:
            raise InvalidArgumentError("read_many takes segments of one head")
        counts = [s.count for s in segments]
        k, v = self._joined_rows(segments, counts)
        positions = ranges(np.array([s.position for s in segments]), np.array(counts))
        return Head(first.layer, first.head, first.seq, k, v, positions)

    def _joined_rows(self, segments: Sequence[Segment], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The K and V rows of ``segments`` one after another: gathered straight from raw chunks,
        or (encoded or quantized chunks) read segment by segment and joined."""
        file = self.file
        k = file.chunk_rows([s.k_chunk for s in segments], [s.k_row for s in segments], counts)
        v = file.chunk_rows([s.v_chunk for s in segments], [s.v_row for s in segments], counts)
        if k is None or v is None:
            heads = [self.read(s) for s in segments]
            return np.concatenate([h.k for h in heads]), np.concatenate([h.v for h in heads])
        return k, v

    def release(self, segment: Segment | Sequence[Segment]) -> None:
        """Drop the pages of the chunks of ``segment`` (or of several segments) from this process
        (views stay valid: the pages fault back in), so a streaming pass keeps a bounded resident
        set. Several segments' chunks are released as few merged ranges (one call for a run of
        neighbouring chunks)."""
        file = self.file
        segments = [segment] if isinstance(segment, Segment) else list(segment)
        if not segments:
            return
        # Sorted and distinct without `np.unique`, whose first call imports numpy.ma (a fresh
        # command's start: `python -m benchmarks.cli_bench`).
        chunks = np.sort(np.array([c for s in segments for c in (s.k_chunk, s.v_chunk)], np.int64))
        chunks = chunks[np.concatenate(([True], chunks[1:] != chunks[:-1]))]
        starts = file.table["offset"][chunks].astype(np.int64)
        ends = starts + DESCRIPTOR_SIZE + file.table["stored_size"][chunks].astype(np.int64)
        # A range starts where a chunk does not begin within a page of the previous one's end.
        breaks = np.flatnonzero(starts[1:] > ends[:-1] + _PAGE) + 1
        for first, last in zip([0, *breaks.tolist()], [*(breaks - 1).tolist(), len(chunks) - 1], strict=True):
            file.source.release(int(starts[first]), int(ends[last] - starts[first]))

    def release_chunk(self, chunk: int) -> None:
        """`release` for one chunk of any kind (an array chunk: a snapshot's recurrent state)."""
        file = self.file
        start = int(file.table["offset"][chunk])
        self.file.source.release(start, DESCRIPTOR_SIZE + int(file.table["stored_size"][chunk]))

    def byte_span(self, segments: Sequence[Segment]) -> tuple[int, int]:
        """``(start, end)``: the file's bytes from the first record to the end of the last record
        of the chunks of ``segments`` (non-empty), other records between them included."""
        file = self.file
        chunks = np.array([c for s in segments for c in (s.k_chunk, s.v_chunk)], np.int64)
        starts = file.table["offset"][chunks].astype(np.int64)
        ends = starts + DESCRIPTOR_SIZE + file.table["stored_size"][chunks].astype(np.int64)
        return int(starts.min()), int(ends.max())

    def release_span(self, start: int, end: int) -> None:
        """`release` for the file's bytes ``[start, end)`` (a `byte_span`): one call for a run of
        records whose segments the caller no longer holds."""
        if end > start:
            self.file.source.release(start, end - start)

    def prefetch(self, segments: list[Segment]) -> None:
        """Announce segments about to be read: a remote source fetches them in few requests (a
        no-op on a memory map)."""
        self.file.prefetch([chunk for seg in segments for chunk in (seg.k_chunk, seg.v_chunk)])


def of(snapshot: Any) -> Pages:
    """The page management of an open `kvformat.Snapshot` for a pass over the whole file: one
    per snapshot, shared by the pass's threads."""
    pages: Pages = snapshot._pages
    return pages
