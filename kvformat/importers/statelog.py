"""Read go-mlx State logs (``*.mvlog``) and ``KVST`` containers: the records, and the block
bundle manifests among them (``../shared/formats/mlxkv001-bundles.md``, sections 3, 4 and 6).

A State log is a file magic followed by records back to back: ``"MVF1"``, ``u64 chunk_id``,
``u64 payload_size``, ``u32 meta_size`` (little-endian), the metadata JSON, the payload. A
``KVST`` container is ``"KVST"``, ``u8 version``, ``u32 header_len`` (big-endian), a JSON header
and a byte-for-byte copy of a log; its frame offsets count from the copy's first byte.

`open_log` scans every record header once (each size checked against the bytes left before
anything is read), keeping ``chunk_id -> record`` and ``offset -> record``; payloads are read
only when asked for. Nothing here is specific to K/V: `kvformat.importers.bundles` builds on it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from kvformat import sniff
from kvformat.errors import CorruptFileError, LimitExceededError, TruncatedFileError, UnsupportedFeatureError

LOG_MAGICS = sniff.STATE_LOGS
CONTAINER_MAGIC = sniff.KVST
RECORD_MAGIC = b"MVF1"
RECORD_HEADER = struct.Struct("<4sQQI")  # magic, chunk_id, payload_size, meta_size: 24 bytes
MAX_META = 16 << 20  # a record's metadata JSON
MAX_JSON = 64 << 20  # a manifest, index or envelope payload read as JSON
MAX_CONTAINER_HEADER = 16 << 20  # as go-rocm's reader caps it
MAX_RECORDS = 1 << 24
CONTAINER_KINDS = {"go-mlx/state-kv": "application/vnd.go-mlx.state-log"}
CONTAINER_KINDS["go-rocm/state-kv"] = "application/vnd.go-rocm.state-log"
BUNDLE_KIND = "go-mlx/kv-snapshot-block-bundle"


@dataclass(frozen=True)
class Record:
    """One record of a log: ``offset`` of its header and ``start`` of its payload, both counted
    from the log's first byte (its magic); ``size`` payload bytes; its metadata JSON."""

    chunk_id: int
    offset: int
    start: int
    size: int
    meta: dict[str, Any]


@dataclass
class Log:
    """A State log, bare or inside a ``KVST`` container, with its records scanned."""

    name: str
    file: BinaryIO
    size: int  # of the whole file
    base: int  # where the log starts in the file (0, or after the container header)
    end: int  # where it ends
    magic: bytes
    container: dict[str, Any] | None = None
    container_version: int | None = None
    records: list[Record] = field(default_factory=list)
    by_id: dict[int, Record] = field(default_factory=dict)
    by_offset: dict[int, Record] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "go-mlx KVST container" if self.container is not None else "go-mlx State log"

    def label(self, what: str) -> str:
        """``what``, prefixed with the file's name unless it already names it."""
        return what if what.startswith(self.name) else f"{self.name}: {what}"

    def _check_span(self, start: int, size: int, what: str) -> None:
        if start < 0 or size < 0 or self.base + start + size > self.end:
            raise TruncatedFileError(
                f"{self.label(what)} ({size} bytes at log offset {start}) runs past the end of the log"
            )

    def read(self, start: int, size: int, what: str) -> bytes:
        """``size`` bytes at log offset ``start`` (checked to lie inside the log)."""
        self._check_span(start, size, what)
        self.file.seek(self.base + start)
        data = self.file.read(size)
        if len(data) != size:
            raise TruncatedFileError(f"{self.label(what)} ends early (the file shrank while being read)")
        return data

    def read_into(self, start: int, size: int, buffer: bytearray, what: str) -> memoryview:
        """`read` into ``buffer`` (at least ``size`` bytes; reused between calls, it spares a fresh
        allocation and its page faults per block); returns a view of the ``size`` bytes read."""
        self._check_span(start, size, what)
        view = memoryview(buffer)[:size]
        self.file.seek(self.base + start)
        if self.file.readinto(view) != size:  # type: ignore[attr-defined]
            raise TruncatedFileError(f"{self.label(what)} ends early (the file shrank while being read)")
        return view

    def payload(self, record: Record, what: str) -> bytes:
        return self.read(record.start, record.size, what)

    def json_payload(self, record: Record, what: str) -> dict[str, Any]:
        """A record's payload parsed as one JSON object (at most `MAX_JSON` bytes)."""
        if record.size > MAX_JSON:
            raise LimitExceededError(f"{self.label(what)} is {record.size} bytes of JSON (limit {MAX_JSON})")
        return parse_json(self.payload(record, what), self.label(what))

    def record_at(self, offset: int, chunk_id: int, what: str) -> Record:
        """The record whose header is at log offset ``offset`` (its ``chunk_id`` checked when
        non-zero)."""
        record = self.by_offset.get(offset)
        if record is None:
            if not 0 <= offset < self.end - self.base:
                raise CorruptFileError(
                    f"{self.label(what)} points at log offset {offset}, outside the log "
                    f"({self.end - self.base} bytes)"
                )
            raise CorruptFileError(
                f"{self.label(what)} points at log offset {offset}, where no record starts"
            )
        if chunk_id and record.chunk_id != chunk_id:
            raise CorruptFileError(
                f"{self.label(what)} names chunk {chunk_id}, but the record at log offset {offset} is "
                f"chunk {record.chunk_id}"
            )
        return record

    def record_of(self, chunk_id: int, what: str) -> Record:
        record = self.by_id.get(chunk_id)
        if record is None:
            raise CorruptFileError(f"{self.label(what)} names chunk {chunk_id}, which the log does not hold")
        return record


def parse_json(data: bytes, what: str) -> dict[str, Any]:
    """``data`` as a JSON object, or a `CorruptFileError` naming ``what``."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptFileError(f"{what} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CorruptFileError(f"{what} is JSON but not an object")
    return value


def kind_of(prefix: bytes) -> str | None:
    """``"container"``, ``"log"`` or None for a file starting with ``prefix``."""
    if prefix.startswith(CONTAINER_MAGIC):
        return "container"
    if any(prefix.startswith(magic) for magic in LOG_MAGICS):
        return "log"
    return None


def open_log(file: BinaryIO, name: str) -> Log:
    """Scan the log in ``file`` (bare, or inside a ``KVST`` container)."""
    size = os.fstat(file.fileno()).st_size
    file.seek(0)
    prefix = file.read(sniff.PREFIX_BYTES)
    kind = kind_of(prefix)
    if kind is None:
        raise CorruptFileError(
            f"{name}: neither a go-mlx State log nor a KVST container (magic {prefix[:8]!r})"
        )
    log = Log(name, file, size, 0, size, b"")
    if kind == "container":
        _container(log)
    head = log.read(0, min(max(len(m) for m in LOG_MAGICS), log.end - log.base), "log magic")
    magic = next((m for m in LOG_MAGICS if head.startswith(m)), None)
    if magic is None:
        raise CorruptFileError(
            f"{name}: the container's payload is not a State log (it starts {head[:16]!r})"
        )
    log.magic = magic
    _scan(log, len(magic))
    return log


def _container(log: Log) -> None:
    """Parse a ``KVST`` header; set where the log lies. ``header_len`` is big-endian in go-rocm's
    packer and unconfirmed in go-mlx's: a little-endian reading is taken only when the big-endian
    one does not fit the file and the little-endian one does."""
    head = log.read(0, min(9, log.size), "KVST header")
    if len(head) < 9:
        raise TruncatedFileError(
            f"{log.name}: KVST container of {log.size} bytes ends inside its 9-byte header"
        )
    version = head[4]
    lengths = [int.from_bytes(head[5:9], "big"), int.from_bytes(head[5:9], "little")]
    fitting = [n for n in lengths if n <= min(MAX_CONTAINER_HEADER, log.size - 9)]
    if not fitting:
        raise LimitExceededError(
            f"{log.name}: KVST header_len {lengths[0]} exceeds the file ({log.size} bytes) or the "
            f"{MAX_CONTAINER_HEADER}-byte cap"
        )
    header: dict[str, Any] | None = None
    problem = ""
    for length in dict.fromkeys(fitting):
        try:
            header = parse_json(log.read(9, length, "KVST header JSON"), f"{log.name}: KVST header")
        except CorruptFileError as exc:
            problem = str(exc)
            continue
        log.base = 9 + length
        break
    if header is None:
        raise CorruptFileError(problem)
    _check_container_header(log, header)
    log.container, log.container_version = header, version


def _check_container_header(log: Log, header: dict[str, Any]) -> None:
    """go-mlx's checks of a container header: kind and content type, payload size, index URI."""
    kind, content_type = header.get("kind"), header.get("content_type")
    if kind not in CONTAINER_KINDS or content_type != CONTAINER_KINDS[kind]:
        raise UnsupportedFeatureError(
            f"{log.name}: KVST container of kind {kind!r} / {content_type!r}; known: "
            + ", ".join(f"{k} / {t}" for k, t in CONTAINER_KINDS.items())
        )
    payload_bytes = header.get("payload_bytes", 0)
    if not isinstance(payload_bytes, int) or payload_bytes < 0:
        raise CorruptFileError(f"{log.name}: KVST payload_bytes {payload_bytes!r} is not a byte count")
    if payload_bytes and payload_bytes != log.size - log.base:
        raise CorruptFileError(
            f"{log.name}: KVST header says {payload_bytes} payload bytes, the file holds "
            f"{log.size - log.base} after the header"
        )
    if not header.get("index_uri"):
        raise CorruptFileError(f"{log.name}: KVST header has no index_uri")


def _scan(log: Log, offset: int) -> None:
    """Read every record header from log offset ``offset`` to the end."""
    length = log.end - log.base
    while offset < length:
        if length - offset < RECORD_HEADER.size:
            raise TruncatedFileError(
                f"{log.name}: the log ends inside a record header at log offset {offset} "
                f"({length - offset} of {RECORD_HEADER.size} bytes)"
            )
        magic, chunk_id, payload_size, meta_size = RECORD_HEADER.unpack(
            log.read(offset, RECORD_HEADER.size, "record header")
        )
        if magic != RECORD_MAGIC:
            raise CorruptFileError(
                f"{log.name}: no record magic 'MVF1' at log offset {offset} (found {magic!r})"
            )
        start = offset + RECORD_HEADER.size + meta_size
        if meta_size > MAX_META or start + payload_size > length:
            raise TruncatedFileError(
                f"{log.name}: record {chunk_id} at log offset {offset} declares {meta_size} metadata and "
                f"{payload_size} payload bytes, past the end of the log ({length} bytes)"
            )
        meta = (
            parse_json(
                log.read(offset + RECORD_HEADER.size, meta_size, "record metadata"),
                f"{log.name}: metadata of record {chunk_id}",
            )
            if meta_size
            else {}
        )
        if chunk_id in log.by_id:
            raise CorruptFileError(
                f"{log.name}: chunk id {chunk_id} appears twice (log offsets "
                f"{log.by_id[chunk_id].offset} and {offset})"
            )
        if len(log.records) >= MAX_RECORDS:
            raise LimitExceededError(f"{log.name}: more than {MAX_RECORDS} records")
        record = Record(chunk_id, offset, start, payload_size, meta)
        log.records.append(record)
        log.by_id[chunk_id] = record
        log.by_offset[offset] = record
        offset = start + payload_size
