"""Byte sources a reader pulls from: a memory map of a local file, or any seekable file object
(remote files: `kvformat.io.remote.RemoteSource`)."""

from __future__ import annotations

import functools
import io
import mmap
import os
import threading
import urllib.parse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import numpy as np

from kvformat.errors import InvalidTypeError, TruncatedFileError

if TYPE_CHECKING:
    from kvformat.io.remote import RangeReader


class Source(Protocol):
    """Random access to the bytes of one file. ``read`` returns exactly ``size`` bytes;
    ``prefetch`` announces ``(offset, size)`` ranges about to be read (``prefetches``: whether
    that does anything, so callers can skip building the ranges); ``release`` says a range is
    no longer needed."""

    name: str
    size: int
    prefetches: bool

    def read(self, offset: int, size: int) -> memoryview: ...

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None: ...

    def release(self, offset: int, size: int) -> None: ...

    def close(self) -> None: ...


@functools.cache
def _madvise_function() -> Any:
    """libc's ``madvise`` through ctypes, which lets other threads run during the call (the
    ``mmap`` module's ``madvise`` holds the GIL while the kernel unmaps the pages); None where
    it cannot be loaded."""
    try:
        import ctypes

        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - platforms without a C madvise
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


class MmapSource:
    """A read-only memory map: ``read`` returns zero-copy views of the page cache."""

    prefetches = False  # the page cache serves a local file

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.name = os.fspath(path)
        with open(self.name, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self._map: mmap.mmap | None = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
            )
        self._view = memoryview(self._map) if self._map is not None else memoryview(b"")
        # Where the map starts, for `release` through libc; the lock keeps `close` from
        # unmapping it while a release is under way (madvise on a range since reused would
        # discard another mapping's pages).
        self._address = np.frombuffer(self._map, np.uint8).ctypes.data if self._map is not None else 0
        self._lock = threading.Lock()

    def read(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise TruncatedFileError(
                f"{self.name}: read of {size} bytes at {offset} passes end of file ({self.size})"
            )
        return self._view[offset : offset + size]

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Nothing to do: the page cache serves a local file."""

    def release(self, offset: int, size: int) -> None:
        """Drop the pages of ``[offset, offset + size)`` from this process (they stay in the page
        cache; a later access faults them back in, so views stay valid). Keeps the resident set
        of a streaming pass over a multi-GB file bounded."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(offset + size, self.size) // mmap.PAGESIZE * mmap.PAGESIZE
        if end <= start:
            return
        madvise = _madvise_function()
        with self._lock:
            if self._map is None:
                return
            if madvise is not None:
                madvise(self._address + start, end - start, mmap.MADV_DONTNEED)
            else:  # pragma: no cover
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Unmap, unless arrays handed out still view the map (then it goes with the last one)."""
        with self._lock:
            try:
                self._view.release()
                if self._map is not None:
                    self._map.close()
            except BufferError:
                pass
            self._map = None


class FileObjectSource:
    """Any seekable binary file object; every ``read`` copies into fresh memory. Thread-safe: a
    read's seek and reads happen under a lock (verify and the analysis passes read on several
    threads)."""

    prefetches = False

    def __init__(self, fileobj: BinaryIO, name: str | None = None) -> None:
        self._file = fileobj
        self._lock = threading.Lock()
        self.name = name or str(getattr(fileobj, "name", "<file object>"))
        try:
            self.size = fileobj.seek(0, io.SEEK_END)
        except (OSError, AttributeError, ValueError) as exc:
            raise InvalidTypeError(f"{self.name}: file object must be seekable ({exc})") from None

    def read(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise TruncatedFileError(
                f"{self.name}: read of {size} bytes at {offset} passes end of file ({self.size})"
            )
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        with self._lock:
            self._file.seek(offset)
            while got < size:
                n = self._file.readinto(view[got:])  # type: ignore[attr-defined]
                if not n:
                    raise TruncatedFileError(f"{self.name}: file ended at {offset + got} while reading")
                got += n
        return view

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        pass

    def release(self, offset: int, size: int) -> None:
        pass

    def close(self) -> None:
        pass


def open_source(
    file: str | os.PathLike[str] | BinaryIO,
    *,
    filesystem: Any = None,
    storage_options: dict[str, Any] | None = None,
    timeout: float | None = None,
) -> Source:
    """The `Source` for what `kvformat.open` was given: a memory map for a local path (or a
    ``file://`` URL), a `FileObjectSource` for a file object, a `kvformat.io.remote.RemoteSource`
    for any other URL or a path inside ``filesystem``."""
    from kvformat.io import remote

    source: Source
    if filesystem is not None or remote.is_url(file):
        assert isinstance(file, str | os.PathLike)
        location = os.fspath(file)
        if filesystem is None and location.startswith("file://"):
            source = MmapSource(urllib.parse.unquote(urllib.parse.urlsplit(location).path))
        else:
            reader = range_reader(
                location,
                filesystem=filesystem,
                storage_options=storage_options,
                timeout=remote.DEFAULT_TIMEOUT if timeout is None else timeout,
            )
            try:
                source = remote.RemoteSource(reader)
            except BaseException:
                reader.close()
                raise
    elif isinstance(file, str | os.PathLike):
        source = MmapSource(file)
    else:
        source = FileObjectSource(file)
    return source


def range_reader(
    path: str,
    *,
    filesystem: Any = None,
    storage_options: dict[str, Any] | None = None,
    timeout: float,
) -> RangeReader:
    """The `RangeReader` for a URL, or for a path inside ``filesystem`` (fsspec or pyarrow)."""
    from kvformat.io.filesystems import ArrowRangeReader, FsspecRangeReader, remote_errors

    if filesystem is not None:
        if hasattr(filesystem, "open_input_file"):
            return ArrowRangeReader(filesystem, path)
        if hasattr(filesystem, "cat_file"):
            return FsspecRangeReader(filesystem, path)
        raise InvalidTypeError(f"{type(filesystem).__name__} is neither an fsspec nor a pyarrow filesystem")
    scheme = path.split("://", 1)[0].lower()
    if scheme in ("http", "https") and set(storage_options or {}) <= {"headers"}:
        from kvformat.io.http_range import HTTPRangeReader

        return HTTPRangeReader(path, timeout=timeout, headers=(storage_options or {}).get("headers"))
    try:
        import fsspec
    except ImportError:
        raise ModuleNotFoundError(
            f"reading {scheme}:// needs fsspec and its {scheme} backend: pip install 'kvsnap[remote]'"
        ) from None
    fs, inner = remote_errors(path, lambda: fsspec.core.url_to_fs(path, **(storage_options or {})))
    return FsspecRangeReader(fs, inner, name=path)
