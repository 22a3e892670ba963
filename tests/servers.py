"""Real servers on loopback for the remote-reading tests: nginx (HTTP with range requests, from
Debian's or Homebrew's package; `make test` installs it) and moto's S3 API in server mode."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@dataclass
class Nginx:
    root: Path
    port: int
    access_log: Path

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def log_lines(self) -> list[str]:
        return self.access_log.read_text().splitlines() if self.access_log.exists() else []

    def bytes_sent(self, since: int = 0) -> int:
        """Body bytes nginx sent for the log lines after the first ``since``."""
        return sum(int(line.split()[2]) for line in self.log_lines()[since:])


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (
            p
            for p in ("/usr/sbin/nginx", "/opt/homebrew/bin/nginx", "/usr/local/bin/nginx")
            if os.path.exists(p)
        ),
        None,
    )
    if found is None:
        raise RuntimeError("nginx is not installed: `make test` installs it (apt-get or brew install nginx)")
    return found


@contextmanager
def nginx(root: Path, work: Path) -> Iterator[Nginx]:
    """nginx serving ``root`` on a free loopback port, logging status and body bytes per request."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = work / "access.log"
    user = "user root;" if os.geteuid() == 0 else ""
    temp = " ".join(
        f"{kind}_temp_path {work / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    config = work / "nginx.conf"
    config.write_text(
        f"""{user}
daemon off;
worker_processes 1;
pid {work / "nginx.pid"};
error_log {work / "error.log"};
events {{ worker_connections 64; }}
http {{
    log_format ranges '$request_uri $status $body_bytes_sent "$http_range"';
    access_log {log} ranges;
    {temp}
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""
    )
    process = subprocess.Popen(
        [nginx_binary(), "-c", str(config), "-p", str(work)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        try:
            wait_for_port(port)
        except RuntimeError:
            process.kill()
            raise RuntimeError(f"nginx did not start: {process.communicate()[1].decode()}") from None
        yield Nginx(root, port, log)
    finally:
        process.terminate()
        process.wait(timeout=10)


@dataclass
class S3:
    endpoint: str
    bucket: str

    @property
    def storage_options(self) -> dict[str, object]:
        return {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": self.endpoint,
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"connect_timeout": 5, "read_timeout": 5, "retries": {"max_attempts": 1}},
        }

    def client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def upload(self, path: Path, key: str) -> str:
        self.client().upload_file(str(path), self.bucket, key)
        return f"s3://{self.bucket}/{key}"


@contextmanager
def moto_s3() -> Iterator[S3]:
    """moto's S3 API in server mode on a free loopback port, with one new bucket (moto keeps its
    state per process, so each server gets a bucket name of its own)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        wait_for_port(port)
        s3 = S3(f"http://127.0.0.1:{port}", f"runs-{uuid.uuid4().hex[:12]}")
        s3.client().create_bucket(Bucket=s3.bucket)
        yield s3
    finally:
        server.stop()


@dataclass
class Quirks:
    """What `quirky_http` does besides serving byte ranges of files in its root."""

    redirects: dict[str, str] = field(default_factory=dict)  # path -> Location
    failures: int = 0  # answer this many requests with 503 first
    header: tuple[str, str] | None = None  # required request header, else 403
    requests: list[str] = field(default_factory=list)


@contextmanager
def quirky_http(root: Path, quirks: Quirks) -> Iterator[str]:
    """A small range-serving HTTP server on loopback with redirects, transient 503s and a
    required header; yields its base URL."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            quirks.requests.append(self.path)
            if self.path in quirks.redirects:
                return self._reply(302, {"Location": quirks.redirects[self.path]})
            if quirks.failures > 0:
                quirks.failures -= 1
                return self._reply(503, {}, b"busy")
            if quirks.header and self.headers.get(quirks.header[0]) != quirks.header[1]:
                return self._reply(403, {}, b"forbidden")
            path = root / self.path.lstrip("/")
            if not path.is_file():
                return self._reply(404, {}, b"")
            data = path.read_bytes()
            first, _, last = self.headers.get("Range", "bytes=0-").removeprefix("bytes=").partition("-")
            start = len(data) - int(last) if not first else int(first)
            stop = len(data) - 1 if not first or not last else min(int(last), len(data) - 1)
            self._reply(
                206,
                {"Content-Range": f"bytes {max(start, 0)}-{stop}/{len(data)}", "ETag": '"v1"'},
                data[max(start, 0) : stop + 1],
            )

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
