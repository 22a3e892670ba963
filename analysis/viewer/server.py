"""The viewer's local server: the standard library's threaded HTTP server (one process, a thread
per request, every browser tab served), bound to 127.0.0.1 unless ``--host`` says otherwise, and
answering only requests that carry the random token of its URL (as Jupyter does): 403 otherwise.
Only the files named on the command line are served, by their number: no request parameter
reaches the file system."""

from __future__ import annotations

import hmac
import json
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from . import data
from .page import render


class ViewerServer(ThreadingHTTPServer):
    """Serves the viewer page and its JSON answers for ``sources``."""

    daemon_threads = True

    def __init__(self, sources: list[data.Source], host: str = "127.0.0.1", port: int = 0) -> None:
        # what the first answers need, imported now: the page's first map does not wait for it

        self.sources = sources
        self.token = secrets.token_urlsafe(24)
        super().__init__((host, port), _Handler)

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


def _int(query: dict[str, list[str]], name: str, default: int | None = None) -> int:
    values = query.get(name)
    if not values:
        if default is None:
            raise data.ViewerError(f"missing parameter {name}")
        return default
    try:
        return int(values[0])
    except ValueError:
        raise data.ViewerError(f"{name} must be an integer") from None


def _span(query: dict[str, list[str]], low: str, high: str) -> tuple[int, int] | None:
    if low not in query and high not in query:
        return None
    return _int(query, low, 0), _int(query, high, 2**53)


class _Handler(BaseHTTPRequestHandler):
    server: ViewerServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet: the terminal shows the URL only
        return

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
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
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
        except data.ViewerError as exc:
            self._json(400, {"error": str(exc)})
        except (ValueError, IndexError, KeyError) as exc:  # a file problem, named in one line
            self._json(400, {"error": f"{type(exc).__name__}: {exc}"})

    def _source(self, query: dict[str, list[str]], name: str = "file") -> data.Source:
        number = _int(query, name, 0)
        if not 0 <= number < len(self.server.sources):
            raise data.ViewerError(f"file {number} is not one of the {len(self.server.sources)} files served")
        return self.server.sources[number]

    def _answer(self, name: str, query: dict[str, list[str]]) -> Any:
        if name == "files":
            return [source.info() for source in self.server.sources]
        if name not in _ANSWERS:
            raise data.ViewerError(f"unknown request {name!r}")
        source = self._source(query)
        if name == "diff":
            return data.difference(source.snap, self._source(query, "other").snap)
        if name == "grid":
            return source.grid((query.get("score") or ["sink_mass"])[0])
        answer = _ANSWERS[name]
        assert answer is not None
        return answer(source.snap, _int(query, "layer", 0), _int(query, "head", 0), query)


def _map(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    return data.attention_map(
        snap,
        layer,
        head,
        queries=_span(query, "q0", "q1"),
        keys=_span(query, "k0", "k1"),
        rows=_int(query, "rows", 256),
        columns=_int(query, "columns", 512),
    )


def _row(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    return data.query_row(snap, layer, head, _int(query, "query"))


def _kept(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    method = (query.get("method") or ["snapkv"])[0]
    try:
        budget = float((query.get("budget") or ["0.25"])[0])
    except ValueError:
        raise data.ViewerError("budget must be a number") from None
    return data.kept(snap, layer, head, method, budget)


def _kv(snap: Any, layer: int, head: int, query: dict[str, list[str]]) -> Any:
    return data.kv_view(snap, layer, head)


_ANSWERS: dict[str, Callable[[Any, int, int, dict[str, list[str]]], Any] | None] = {
    "grid": None,  # (the file's, not a head's)
    "diff": None,  # (two files')
    "map": _map,
    "row": _row,
    "kept": _kept,
    "kv": _kv,
}
"""Requests about one head of a file, by name: each answered from the file, the layer and the head."""
