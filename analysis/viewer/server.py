"""The viewer's local server: the standard library's threaded HTTP server (one process, a thread
per request, every browser tab served), bound to 127.0.0.1 unless ``--host`` says otherwise, and
answering only requests that carry the random token of its URL (as Jupyter does) and name this
server in their ``Host`` header (a page of another origin that rebinds its name to this address
is refused): 403 otherwise. Only the files named on the command line are served, by their
number: no request parameter reaches the file system.

Every parameter is parsed before any work: an integer is at most 16 digits and inside the extent
of what it names (a layer of the file, a position of its tokens, a tile count), so no answer's
size is unbounded; anything else is a 400 with one line. An error that is kvsnap's own is a 500
with one line (its traceback goes to the server's standard error), and the server goes on."""

from __future__ import annotations

import base64
import hmac
import json
import re
import secrets
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from kvformat import KVSnapError

from . import data
from .page import render


class ViewerServer(ThreadingHTTPServer):
    """Serves the viewer page and its JSON answers for ``sources``."""

    daemon_threads = True

    def __init__(self, sources: list[data.Source], host: str = "127.0.0.1", port: int = 0) -> None:
        self.sources = sources
        self.token = secrets.token_urlsafe(24)
        self.host = host
        super().__init__((host, port), _Handler)

    def names(self) -> set[str]:
        """The ``Host`` header values this server answers: loopback names and the address served,
        each with the port."""
        port = int(self.server_address[1])
        hosts = {"127.0.0.1", "localhost", "[::1]", self.host if ":" not in self.host else f"[{self.host}]"}
        return {f"{host}:{port}" for host in hosts}

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), int(self.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/?token={self.token}"

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (for notebooks and tests); `shutdown` stops it."""
        thread = threading.Thread(target=self.serve_forever, name="kvsnap-view", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        for source in self.sources:
            source.close()


_INTEGER = re.compile(r"-?[0-9]{1,16}")


def _int(
    query: dict[str, list[str]],
    name: str,
    default: int | None = None,
    low: int = -(2**53),
    high: int = 2**53,
) -> int:
    """Parameter ``name`` as an integer in ``low .. high`` (both included), or ``default`` when
    absent; `ViewerError` (a 400) for anything else, before any work."""
    values = query.get(name)
    if not values:
        if default is None:
            raise data.ViewerError(f"missing parameter {name}")
        return default
    text = values[0]
    if not _INTEGER.fullmatch(text):
        raise data.ViewerError(f"{name} must be an integer of at most 16 digits")
    value = int(text)
    if not low <= value <= high:
        raise data.ViewerError(f"{name} {value} is outside {low}..{high}")
    return value


def _span(query: dict[str, list[str]], low: str, high: str, end: int) -> tuple[int, int] | None:
    """Positions ``[low, high)`` inside ``0 .. end`` (the file's extent), or None when neither is
    given."""
    if low not in query and high not in query:
        return None
    start, stop = _int(query, low, 0, 0, end), _int(query, high, end, 0, end)
    if start >= stop:
        raise data.ViewerError(f"{low} {start} must be below {high} {stop}")
    return start, stop


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet: the terminal shows the URL only
        return

    def setup(self) -> None:
        super().setup()
        # headers and body leave as two writes: without this, the body of a small answer waits
        # for the browser's delayed acknowledgement (40 ms on Linux)
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header(
            "Content-Security-Policy", "default-src 'self' 'unsafe-inline'; img-src 'self' data:"
        )
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, value: Any) -> None:
        self._send(status, json.dumps(value, allow_nan=False).encode(), "application/json")

    def do_GET(self) -> None:
        try:
            self._get()
        except (BrokenPipeError, ConnectionResetError):
            return  # the page gave up on this answer (a newer request superseded it)

    def _get(self) -> None:
        if self.headers.get("Host", "") not in self.server.names():
            self._send(403, b"forbidden: the Host header does not name this server\n", "text/plain")
            return
        parts = urlsplit(self.path)
        try:
            query = parse_qs(parts.query, strict_parsing=False, max_num_fields=64)
        except ValueError:
            self._json(400, {"error": "too many parameters"})
            return
        given = (query.get("token") or [""])[0]
        if not hmac.compare_digest(given.encode(), self.server.token.encode()):
            self._send(
                403, b"forbidden: open the URL kvsnap view printed (it carries the token)\n", "text/plain"
            )
            return
        try:
            if parts.path == "/":
                page = render(None, {"token": self.server.token, "files": len(self.server.sources)})
                self._send(200, page.encode(), "text/html; charset=utf-8")
                return
            if not parts.path.startswith("/api/"):
                self._send(404, b"not found\n", "text/plain")
                return
            self._json(200, self._answer(parts.path.removeprefix("/api/"), query))
        except (BrokenPipeError, ConnectionResetError):
            raise
        except data.ViewerError as exc:  # a request this viewer cannot answer
            self._json(400, {"error": str(exc)})
        except KVSnapError as exc:  # a request the file cannot answer, or a file problem: one line
            self._json(400, {"error": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:  # kvsnap's own bug: one line here, its traceback on the server's stderr
            traceback.print_exc(file=sys.stderr)
            why = f"internal error ({type(exc).__name__}); the server's standard error has the traceback"
            self._json(500, {"error": why})

    def _source(self, query: dict[str, list[str]], name: str = "file") -> data.Source:
        count = len(self.server.sources)
        number = _int(query, name, 0)
        if not 0 <= number < count:
            raise data.ViewerError(f"file {number} is not one of the {count} files served")
        return self.server.sources[number]

    def _answer(self, name: str, query: dict[str, list[str]]) -> Any:
        if name == "files":
            return [source.info() for source in self.server.sources]
        if name not in _ANSWERS:
            raise data.ViewerError(f"unknown request {name!r}")
        source = self._source(query)
        if name == "diff":
            return data.difference(source.snap, self._source(query, "other").snap)
        if name == "mapdiff":
            return _map_difference(source.snap, self._source(query, "other").snap, query)
        if name == "grid":
            return source.grid((query.get("score") or ["sink_mass"])[0])
        answer = _ANSWERS[name]
        assert answer is not None
        snap = source.snap
        layer = _int(query, "layer", 0, 0, snap.num_layers - 1)
        head = _int(query, "head", 0, -1, data.MAX_HEADS)  # -1: the mean over a layer's query heads
        return answer(snap, layer, head, query)


def _map(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    tiling = _tiling(query, snap.seq_len)
    answer = data.attention_map(snap, layer, head, **tiling)
    return _tiles_encoded(answer) if tiling["as_array"] else answer


def _tiling(query: dict[str, list[str]], end: int) -> dict[str, Any]:
    """A map's query and key spans (inside ``0 .. end``), its tile counts, and whether its tiles
    go as float32 bytes (``encoding=f32``)."""
    encoding = (query.get("encoding") or ["json"])[0]
    if encoding not in ("json", "f32"):
        raise data.ViewerError("encoding must be json or f32")
    return {
        "queries": _span(query, "q0", "q1", end),
        "keys": _span(query, "k0", "k1", end),
        "rows": _int(query, "rows", 256, 1, data.MAX_TILES),
        "columns": _int(query, "columns", 512, 1, data.MAX_TILES),
        "as_array": encoding == "f32",
    }


def _tiles_encoded(answer: dict[str, Any]) -> dict[str, Any]:
    """``tiles`` as ``tiles_f32`` (base64 of little-endian float32, rows one after another; NaN
    where a tile shows nothing) and ``shape``: about the size of the JSON text, but written
    without formatting 250k numbers and read by the page without parsing them."""
    tiles = answer.pop("tiles")
    answer["shape"] = list(tiles.shape)
    answer["tiles_f32"] = base64.b64encode(np.ascontiguousarray(tiles, "<f4").tobytes()).decode("ascii")
    return answer


def _map_difference(a: Any, b: Any, query: dict[str, list[str]]) -> Any:
    layer = _int(query, "layer", 0, 0, min(a.num_layers, b.num_layers) - 1)
    tiling = _tiling(query, min(a.seq_len, b.seq_len))
    answer = data.attention_difference(a, b, layer, _int(query, "head", 0, 0, data.MAX_HEADS), **tiling)
    return _tiles_encoded(answer) if tiling["as_array"] else answer


def _qk(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    return data.qk_projection(
        snap, layer, head, limit=_int(query, "points", data.MAX_POINTS, 16, data.MAX_POINTS)
    )


def _row(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    return data.query_row(snap, layer, head, _int(query, "query", None, 0, max(snap.seq_len - 1, 0)))


def _kept(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    method = (query.get("method") or ["snapkv"])[0]
    try:
        budget = float((query.get("budget") or ["0.25"])[0][:32])
    except ValueError:
        raise data.ViewerError("budget must be a number") from None
    if not 0 < budget <= 1:  # NaN included
        raise data.ViewerError("budget must be in (0, 1]")
    return data.kept(snap, layer, head, method, budget)


def _kv(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    return data.kv_view(snap, layer, head)


_ANSWERS: dict[str, Callable[[Any, int, int, dict[str, list[str]]], Any] | None] = {
    "grid": None,  # (the file's, not a head's)
    "diff": None,  # (two files')
    "mapdiff": None,  # (two files')
    "qk": _qk,
    "map": _map,
    "row": _row,
    "kept": _kept,
    "kv": _kv,
}
"""Requests about one head of a file, by name: each answered from the file, the layer and the head."""
