"""Reading `.kv` files where they are stored: HTTP(S) byte ranges, fsspec and pyarrow filesystems.

A `RemoteSource` serves the reader's ``read(offset, size)`` calls from byte-range requests:

- opening fetches the last 64 KiB (footer, and the whole index when it fits) and the 64-byte header:
  two requests for most files, a third when the index is larger;
- ``prefetch(ranges)`` fetches every range a read is about to need in one go, merging ranges
  closer than ``gap`` bytes and running up to ``concurrency`` requests at once (``Snapshot.head``
  announces all chunks of a head; ``Snapshot.blocks`` announces the next ``read_ahead`` bytes);
- fetched spans are kept in a small LRU cache (``cache_bytes``) and dropped once the reader
  releases them.

Backends: ``http://`` and ``https://`` with the standard library only (keep-alive connection per
thread, timeouts, redirects, retries of 429/5xx answers, extra request headers from
``storage_options={"headers": {...}}``, the file's ETag pinned with ``If-Match`` so a file
replaced mid-read is an error, not a mix of two files); any other ``scheme://`` through fsspec
(``pip install kvsnap[remote]`` brings fsspec and s3fs); and any fsspec or pyarrow filesystem
object passed as ``filesystem=``.
Every network failure, timeout, missing object and short read is a `RemoteError` (or
`TruncatedFileError`), i.e. a `KVFormatError` naming the file.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from kvformat.errors import RemoteError, RemoteNotFoundError, TruncatedFileError

TAIL_BYTES = 64 * 1024
DEFAULT_TIMEOUT = 30.0
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


class RemoteSource:
    """A `Source` over a `RangeReader` with range coalescing, read-ahead and a bounded cache.

    ``bytes_fetched`` and ``requests`` count what went over the wire (for tests and benchmarks).
    """

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
        """Fetch ``(offset, size)`` ranges the reader will ask for next: uncached ones only,
        merged when less than ``gap`` bytes apart, several requests at once."""
        wanted = sorted(
            (o, s)
            for o, s in ranges
            if s > 0 and o >= 0 and o + s <= self.size and self._lookup(o, s) is None
        )
        # Announce no more than half the cache: spans evicted before they are read would be
        # fetched twice. What is left is fetched range by range as it is read.
        budget = self.cache_bytes // 2
        for i, (_, size) in enumerate(wanted):
            budget -= size
            if budget < 0:
                wanted = wanted[: max(i, 1)]
                break
        spans: list[list[int]] = []
        for offset, size in wanted:
            if spans and offset <= spans[-1][1] + self.gap:
                spans[-1][1] = max(spans[-1][1], offset + size)
            else:
                spans.append([offset, offset + size])
        if not spans:
            return
        if len(spans) == 1 or self.concurrency == 1:
            for start, end in spans:
                self._store(start, self._fetch(start, end - start))
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="kvsnap-range")
        futures = [(start, self._pool.submit(self._fetch, start, end - start)) for start, end in spans]
        for start, future in futures:
            self._store(start, future.result())

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


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


REDIRECTS = (301, 302, 303, 307, 308)
RETRY_STATUS = (429, 500, 502, 503, 504)
MAX_REDIRECTS = 5
RETRY_DELAYS = (0.25, 0.5, 1.0)  # seconds before each retry of a 429/5xx answer


class HTTPRangeReader:
    """``Range`` requests over HTTP/1.1 with the standard library: one keep-alive connection per
    thread, ``timeout`` seconds per socket operation, one retry on a dropped connection, up to
    three retries of 429/5xx answers (0.25, 0.5, 1 s apart), up to five redirects (the final
    location is kept for later requests, e.g. a presigned object-store URL)."""

    def __init__(
        self, url: str, *, timeout: float = DEFAULT_TIMEOUT, headers: dict[str, str] | None = None
    ) -> None:
        self.name = url
        self._timeout = timeout
        self._headers = dict(headers or {})
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []
        self._connections_lock = threading.Lock()
        self._size = -1
        self._etag: str | None = None
        self._locate(url)

    def _locate(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RemoteError(f"{self.name}: not an http(s) URL: {url!r}")
        self._origin = (parts.scheme, parts.hostname, parts.port)
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._url = url

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "origin", None) != self._origin:
            self._drop_connection()
            conn = None
        if conn is None:
            scheme, host, port = self._origin
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = cls(host, port, timeout=self._timeout)
            self._local.conn = conn
            self._local.origin = self._origin
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def _send(self, headers: dict[str, str]) -> http.client.HTTPResponse:
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.request("GET", self._target, headers=headers)
                return conn.getresponse()
            except TimeoutError as exc:
                self._drop_connection()
                raise RemoteError(f"{self.name}: no answer within {self._timeout:g} s ({exc})") from None
            except (ConnectionError, http.client.HTTPException, OSError) as exc:
                self._drop_connection()
                if attempt:
                    raise RemoteError(f"{self.name}: {type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    def _get(self, byte_range: str) -> tuple[int, http.client.HTTPResponse]:
        headers = {**self._headers, "Range": byte_range}
        if self._etag is not None:
            headers["If-Match"] = self._etag
        redirects = retries = 0
        while True:
            response = self._send(headers)
            status = response.status
            if status in REDIRECTS:
                location = response.getheader("Location")
                self._drop_connection()  # the body of a redirect is not wanted
                if not location or redirects >= MAX_REDIRECTS:
                    raise RemoteError(f"{self.name}: too many redirects or a redirect without a Location")
                redirects += 1
                self._locate(urllib.parse.urljoin(self._url, location))
                continue
            if status in RETRY_STATUS and retries < len(RETRY_DELAYS):
                self._drop_connection()
                time.sleep(RETRY_DELAYS[retries])
                retries += 1
                continue
            return status, response

    def _body(self, response: http.client.HTTPResponse, expected: int) -> bytes:
        try:
            data = response.read()
        except TimeoutError:
            self._drop_connection()
            raise RemoteError(f"{self.name}: body stalled for {self._timeout:g} s") from None
        except http.client.IncompleteRead as exc:
            self._drop_connection()
            raise TruncatedFileError(
                f"{self.name}: connection closed after {len(exc.partial)} of {expected} bytes"
            ) from None
        except (ConnectionError, OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            raise RemoteError(f"{self.name}: {type(exc).__name__} while reading: {exc}") from None
        if response.will_close:
            self._drop_connection()
        return data

    def _fail(self, status: int, response: http.client.HTTPResponse, what: str) -> None:
        self._drop_connection()  # never read a body we did not ask for (a 200 may be the whole file)
        if status in (404, 410):
            raise RemoteNotFoundError(f"{self.name}: not found (HTTP {status})")
        if status == 412:
            raise RemoteError(f"{self.name}: the file changed on the server since it was opened")
        if status == 416:
            raise TruncatedFileError(f"{self.name}: {what} passes the end of the file on the server")
        if status == 200:
            raise RemoteError(f"{self.name}: the server ignores Range requests (HTTP 200 for {what})")
        raise RemoteError(f"{self.name}: HTTP {status} {response.reason} for {what}")

    def _content_range(self, response: http.client.HTTPResponse) -> tuple[int, int, int]:
        match = _CONTENT_RANGE.fullmatch(response.getheader("Content-Range", "").strip())
        if match is None or match.group(3) == "*":
            self._drop_connection()
            raise RemoteError(f"{self.name}: 206 answer without a usable Content-Range header")
        return int(match.group(1)), int(match.group(2)), int(match.group(3))

    def open(self, tail: int) -> tuple[int, bytes]:
        status, response = self._get(f"bytes=-{tail}")
        if status == 416:  # an empty file has no last byte
            self._body(response, 0)
            self._size = 0
            return 0, b""
        if status != 206:
            self._fail(status, response, f"the last {tail} bytes")
        start, end, total = self._content_range(response)
        self._etag = response.getheader("ETag")
        if self._etag is not None and self._etag.startswith("W/"):
            self._etag = None  # a weak validator cannot pin byte ranges
        data = self._body(response, end - start + 1)
        if len(data) != end - start + 1 or end != total - 1:
            raise TruncatedFileError(f"{self.name}: short answer to the tail request")
        self._size = total
        return total, data

    def fetch(self, offset: int, size: int) -> bytes:
        what = f"bytes {offset}..{offset + size - 1}"
        status, response = self._get(f"bytes={offset}-{offset + size - 1}")
        if status != 206:
            self._fail(status, response, what)
        start, end, total = self._content_range(response)
        if total != self._size:
            self._drop_connection()
            raise RemoteError(f"{self.name}: size changed on the server ({self._size} -> {total} bytes)")
        if start != offset or end != offset + size - 1:
            self._drop_connection()
            raise RemoteError(f"{self.name}: server answered bytes {start}..{end} for {what}")
        return self._body(response, size)

    def close(self) -> None:
        with self._connections_lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()


def _remote_errors(name: str, call: Callable[[], Any]) -> Any:
    """Run a filesystem call, turning its exceptions into `RemoteError`s that name the file."""
    try:
        return call()
    except FileNotFoundError:
        raise RemoteNotFoundError(f"{name}: not found") from None
    except (RemoteError, TruncatedFileError):
        raise
    except Exception as exc:
        raise RemoteError(f"{name}: {type(exc).__name__}: {exc}") from None


class FsspecRangeReader:
    """Byte ranges through an fsspec filesystem (``cat_file`` with ``start``/``end``)."""

    def __init__(self, filesystem: Any, path: str, name: str | None = None) -> None:
        self._fs = filesystem
        self._path = path
        self.name = name or path

    def open(self, tail: int) -> tuple[int, bytes]:
        size = int(_remote_errors(self.name, lambda: self._fs.size(self._path)))
        return size, self.fetch(max(0, size - tail), min(tail, size)) if size else b""

    def fetch(self, offset: int, size: int) -> bytes:
        return bytes(
            _remote_errors(self.name, lambda: self._fs.cat_file(self._path, start=offset, end=offset + size))
        )

    def close(self) -> None:
        pass


class ArrowRangeReader:
    """Byte ranges through a pyarrow filesystem (``open_input_file`` + ``read_at``), duck-typed so
    that kvformat never imports pyarrow."""

    def __init__(self, filesystem: Any, path: str, name: str | None = None) -> None:
        self.name = name or path
        self._file = _remote_errors(self.name, lambda: filesystem.open_input_file(path))

    def open(self, tail: int) -> tuple[int, bytes]:
        size = int(_remote_errors(self.name, self._file.size))
        return size, self.fetch(max(0, size - tail), min(tail, size)) if size else b""

    def fetch(self, offset: int, size: int) -> bytes:
        return bytes(_remote_errors(self.name, lambda: self._file.read_at(size, offset)))

    def close(self) -> None:
        self._file.close()


def range_reader(
    path: str,
    *,
    filesystem: Any = None,
    storage_options: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> RangeReader:
    """The `RangeReader` for a URL, or for a path inside ``filesystem`` (fsspec or pyarrow)."""
    if filesystem is not None:
        if hasattr(filesystem, "open_input_file"):
            return ArrowRangeReader(filesystem, path)
        if hasattr(filesystem, "cat_file"):
            return FsspecRangeReader(filesystem, path)
        raise TypeError(f"{type(filesystem).__name__} is neither an fsspec nor a pyarrow filesystem")
    scheme = path.split("://", 1)[0].lower()
    if scheme in ("http", "https") and set(storage_options or {}) <= {"headers"}:
        return HTTPRangeReader(path, timeout=timeout, headers=(storage_options or {}).get("headers"))
    try:
        import fsspec
    except ImportError:
        raise ModuleNotFoundError(
            f"reading {scheme}:// needs fsspec and its {scheme} backend: pip install 'kvsnap[remote]'"
        ) from None
    fs, inner = _remote_errors(path, lambda: fsspec.core.url_to_fs(path, **(storage_options or {})))
    return FsspecRangeReader(fs, inner, name=path)


def expand(pattern: str, *, storage_options: dict[str, Any] | None = None) -> list[str]:
    """URLs matching a glob pattern (``s3://bucket/runs/*.kv``), sorted; a pattern without glob
    characters comes back unchanged. HTTP has no listing, so only exact URLs work there."""
    if not any(c in pattern for c in "*?["):
        return [pattern]
    scheme = pattern.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        raise ValueError(f"{pattern}: HTTP servers cannot be listed; give each URL")
    try:
        import fsspec
    except ImportError:
        raise ModuleNotFoundError(
            f"listing {scheme}:// needs fsspec and its {scheme} backend: pip install 'kvsnap[remote]'"
        ) from None
    fs, inner = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return sorted(f"{protocol}://{match}" for match in fs.glob(inner))
