"""Reading `.kv` files where they are stored: HTTP(S) byte ranges, fsspec and pyarrow filesystems.

A `RemoteSource` serves the reader's ``read(offset, size)`` calls from byte-range requests:

- opening fetches the last 64 KiB (footer, and the whole index when it fits) and the 64-byte header:
  two requests for most files, a third when the index is larger;
- ``prefetch(ranges)`` fetches every range a read is about to need in one go, merging ranges
  closer than ``gap`` bytes and running up to ``concurrency`` requests at once (``Snapshot.head``
  announces all chunks of a head; ``Snapshot.blocks`` announces the next ``read_ahead`` bytes);
- fetched spans are kept in a small LRU cache (``cache_bytes``) and dropped once the reader
  releases them.

Backends (`kvformat.io.source.range_reader` picks one): ``http://`` and ``https://`` with the
standard library only (`kvformat.io.http_range`) (keep-alive connection per
thread, timeouts, redirects, retries of 429/5xx answers, extra request headers from
``storage_options={"headers": {...}}``, the file's ETag pinned with ``If-Match`` so a file
replaced mid-read is an error, not a mix of two files); any other ``scheme://`` through fsspec
(``pip install kvsnap[remote]`` brings fsspec and s3fs); and any fsspec or pyarrow filesystem
object passed as ``filesystem=`` (`kvformat.io.filesystems`).
Every network failure, timeout, missing object and short read is a `RemoteError` (or
`TruncatedFileError`), i.e. a `KVFormatError` naming the file.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from kvformat.errors import TruncatedFileError

TAIL_BYTES = 64 * 1024
DEFAULT_TIMEOUT = 30.0  # seconds a remote read waits for an answer before it fails
DEFAULT_GAP = 16 * 1024
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_CONCURRENCY = 4
READ_AHEAD = 8 * 1024 * 1024


class RangeReader(Protocol):
    """One remote object: its size and exact byte ranges of it."""

    name: str

    def open(self, tail: int) -> tuple[int, bytes]:
        """Total size and the last ``min(tail, size)`` bytes."""
        ...

    def fetch(self, offset: int, size: int) -> bytes:
        """Exactly ``size`` bytes at ``offset`` (raises on a short read)."""
        ...

    def close(self) -> None: ...


def is_url(path: object) -> bool:
    """True for ``scheme://...`` strings other than Windows drive letters."""
    return isinstance(path, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]+://", path) is not None


def plan_fetches(wanted: Sequence[tuple[int, int]], gap: int, budget: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans to fetch for ``(offset, size)`` ranges not yet held: sorted,
    ranges less than ``gap`` bytes apart merged into one span, and no more than ``budget`` bytes
    of ranges (at least one range): spans evicted from the cache before they are read would be
    fetched twice, so what is past the budget is fetched range by range as it is read."""
    kept: list[tuple[int, int]] = []
    for offset, size in sorted(wanted):
        budget -= size
        if budget < 0 and kept:
            break
        kept.append((offset, size))
    spans: list[tuple[int, int]] = []
    for offset, size in kept:
        if spans and offset <= spans[-1][1] + gap:
            spans[-1] = (spans[-1][0], max(spans[-1][1], offset + size))
        else:
            spans.append((offset, offset + size))
    return spans


class RemoteSource:
    """A `Source` over a `RangeReader` with range coalescing, read-ahead and a bounded cache.

    ``bytes_fetched`` and ``requests`` count what went over the wire (for tests and benchmarks).
    """

    prefetches = True

    def __init__(
        self,
        reader: RangeReader,
        *,
        gap: int = DEFAULT_GAP,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        self.reader = reader
        self.name = reader.name
        self.gap = gap
        self.cache_bytes = cache_bytes
        self.concurrency = max(1, concurrency)
        self.bytes_fetched = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._spans: OrderedDict[int, bytes] = OrderedDict()  # start offset -> bytes, LRU order
        self._cached = 0
        self._pool: ThreadPoolExecutor | None = None
        self.size, tail = reader.open(TAIL_BYTES)
        self._count(len(tail))
        if tail:
            self._store(self.size - len(tail), tail)

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_fetched += n
            self.requests += 1

    def _store(self, start: int, data: bytes) -> None:
        with self._lock:
            old = self._spans.pop(start, None)
            if old is not None:
                self._cached -= len(old)
            self._spans[start] = data
            self._cached += len(data)
            while self._cached > self.cache_bytes and len(self._spans) > 1:
                _, dropped = self._spans.popitem(last=False)
                self._cached -= len(dropped)

    def _lookup(self, offset: int, size: int) -> memoryview | None:
        with self._lock:
            for start, data in self._spans.items():
                if start <= offset and offset + size <= start + len(data):
                    self._spans.move_to_end(start)
                    return memoryview(data)[offset - start : offset - start + size]
        return None

    def _fetch(self, offset: int, size: int) -> bytes:
        data = self.reader.fetch(offset, size)
        self._count(len(data))
        if len(data) != size:
            raise TruncatedFileError(
                f"{self.name}: asked for {size} bytes at {offset}, the server sent {len(data)}"
            )
        return data

    def read(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise TruncatedFileError(
                f"{self.name}: read of {size} bytes at {offset} passes end of file ({self.size})"
            )
        if size == 0:
            return memoryview(b"")
        cached = self._lookup(offset, size)
        if cached is not None:
            return cached
        data = self._fetch(offset, size)
        self._store(offset, data)
        return memoryview(data)

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Fetch ``(offset, size)`` ranges the reader will ask for next (`plan_fetches`: the
        uncached ones, merged when less than ``gap`` bytes apart), several requests at once."""
        wanted = [(o, s) for o, s in ranges if self._fetchable(o, s)]
        spans = plan_fetches(wanted, self.gap, self.cache_bytes // 2)
        if len(spans) <= 1 or self.concurrency == 1:
            for start, end in spans:
                self._store(start, self._fetch(start, end - start))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="kvsnap-range")
        futures = [(start, self._pool.submit(self._fetch, start, end - start)) for start, end in spans]
        for start, future in futures:
            self._store(start, future.result())

    def _fetchable(self, offset: int, size: int) -> bool:
        """A non-empty range inside the file, not cached."""
        return offset >= 0 and size > 0 and offset + size <= self.size and self._lookup(offset, size) is None

    def release(self, offset: int, size: int) -> None:
        """The reader is done with everything before ``offset + size``: drop those spans."""
        end = offset + size
        with self._lock:
            for start in [s for s, d in self._spans.items() if s + len(d) <= end]:
                self._cached -= len(self._spans.pop(start))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            self._spans.clear()
            self._cached = 0
        self.reader.close()


def expand(pattern: str, *, storage_options: dict[str, Any] | None = None) -> list[str]:
    """URLs matching a glob pattern (``s3://bucket/runs/*.kv``), sorted (`kvformat.io.filesystems.glob`)."""
    from kvformat.io.filesystems import glob

    return glob(pattern, storage_options=storage_options)
