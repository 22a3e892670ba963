"""Byte ranges and listings through filesystem objects: fsspec (``s3://`` and any other scheme
fsspec knows) and pyarrow filesystems, duck-typed so that kvformat imports neither."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvformat.errors import InvalidArgumentError, RemoteError, RemoteNotFoundError, TruncatedFileError


def remote_errors(name: str, call: Callable[[], Any]) -> Any:
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
        size = int(remote_errors(self.name, lambda: self._fs.size(self._path)))
        return size, self.fetch(max(0, size - tail), min(tail, size)) if size else b""

    def fetch(self, offset: int, size: int) -> bytes:
        return bytes(
            remote_errors(self.name, lambda: self._fs.cat_file(self._path, start=offset, end=offset + size))
        )

    def close(self) -> None:
        pass


class ArrowRangeReader:
    """Byte ranges through a pyarrow filesystem (``open_input_file`` + ``read_at``), duck-typed so
    that kvformat never imports pyarrow."""

    def __init__(self, filesystem: Any, path: str, name: str | None = None) -> None:
        self.name = name or path
        self._file = remote_errors(self.name, lambda: filesystem.open_input_file(path))

    def open(self, tail: int) -> tuple[int, bytes]:
        size = int(remote_errors(self.name, self._file.size))
        return size, self.fetch(max(0, size - tail), min(tail, size)) if size else b""

    def fetch(self, offset: int, size: int) -> bytes:
        return bytes(remote_errors(self.name, lambda: self._file.read_at(size, offset)))

    def close(self) -> None:
        self._file.close()


def glob(pattern: str, *, storage_options: dict[str, Any] | None = None) -> list[str]:
    """URLs matching a glob pattern (``s3://bucket/runs/*.kv``), sorted; a pattern without glob
    characters comes back unchanged. HTTP has no listing, so only exact URLs work there."""
    if not any(c in pattern for c in "*?["):
        return [pattern]
    scheme = pattern.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        raise InvalidArgumentError(f"{pattern}: HTTP servers cannot be listed; give each URL")
    try:
        import fsspec
    except ImportError:
        raise ModuleNotFoundError(
            f"listing {scheme}:// needs fsspec and its {scheme} backend: pip install 'kvsnap[remote]'"
        ) from None
    fs, inner = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return sorted(f"{protocol}://{match}" for match in fs.glob(inner))
