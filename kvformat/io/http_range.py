"""Byte ranges over HTTP(S) with the standard library only: a keep-alive connection per thread,
timeouts, redirects, retries of 429/5xx answers, extra request headers, and the file's ETag
pinned with ``If-Match`` so that a file replaced mid-read is an error, not a mix of two files."""

from __future__ import annotations

import http.client
import re
import threading
import time
import urllib.parse

from kvformat.errors import RemoteError, RemoteNotFoundError, TruncatedFileError
from kvformat.io.remote import DEFAULT_TIMEOUT

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
