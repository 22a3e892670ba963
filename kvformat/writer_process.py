"""A `Writer` in a process of its own, fed through a pipe.

A `Writer` spends most of a small append in Python: checking each layer's rows, laying out and
checksumming hundreds of chunk descriptors, keeping the index. In a thread of the process that
generates, all of that holds the interpreter lock the generating thread needs to build its next
step. `WriterProcess` takes the same calls (`drop`, `append_many`, `append_queries`,
`append_selection`, `snapshot`, `close`) and runs them in a child process: the parent only
copies the arrays' bytes into a pipe (``os.writev``, without the lock) and waits for the
child's reply (``os.read``, without the lock).

Calls before a `snapshot` (or `close`) are queued and sent with it, as one message; its reply
carries the snapshot's index or the first error, raised in the caller as the child raised it
(kvformat's errors and ``OSError`` by class and message). A child that dies leaves its
``.partial`` file as a killed process would (recoverable with `recover`); a parent that dies
closes the child's pipe, and the child leaves the ``.partial`` file and exits.

Wire format (both directions): a 16-byte header, the JSON part's length and the data part's
length as little-endian uint64, then the UTF-8 JSON, then the data. A request's JSON is
``{"ops": [[name, ...arguments]], "arrays": [[dtype, shape, offset]]}``; an argument
``{"array": i}`` is the i-th array, read from the data part at its offset (C order). A reply's
JSON is ``{"ok": result}`` or ``{"error": [class name, message, errno or null]}``.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvformat import errors as kv_errors
from kvformat.dtypes import numpy_dtype
from kvformat.errors import InvalidLayoutError, WriterProcessError
from kvformat.manifest import LayerSpec, dumps, parse_layer
from kvformat.writer import _IOV_MAX, Writer, _skip_written

_HEADER = 16
FLUSH_BYTES = 64 << 20
"""Array bytes a request carries before queued calls are sent (the child's buffer's size)."""


def _read_exact(fd: int, size: int) -> bytearray | None:
    """``size`` bytes from ``fd``; None at end of file before the first byte."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            if got == 0:
                return None
            raise EOFError(f"pipe closed after {got} of {size} bytes")
        got += n
    return buffer


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """Write flat byte ``buffers`` in order (``os.writev``, continued after partial writes)."""
    views = [view for view in buffers if view.nbytes]
    i = 0
    while i < len(views):
        i = _skip_written(views, i, os.writev(fd, views[i : i + _IOV_MAX]))


def _send(fd: int, message: Any, data: Sequence[memoryview] = ()) -> None:
    text = message if isinstance(message, bytes) else dumps(message)
    size = sum(view.nbytes for view in data)
    header = len(text).to_bytes(8, "little") + size.to_bytes(8, "little")
    _write_all(fd, [memoryview(header), memoryview(text), *data])


def _receive(fd: int) -> tuple[Any, bytearray] | None:
    header = _read_exact(fd, _HEADER)
    if header is None:
        return None
    text_size = int.from_bytes(header[:8], "little")
    data_size = int.from_bytes(header[8:], "little")
    text = _read_exact(fd, text_size) if text_size else bytearray()
    data = _read_exact(fd, data_size) if data_size else bytearray()
    if text is None or data is None:
        raise EOFError("pipe closed inside a message")
    return json.loads(bytes(text)), data


class _Arrays:
    """The arrays of one request: each replaced by ``{"array": i}`` in the JSON, its bytes
    appended to the data part."""

    def __init__(self) -> None:
        self.described: list[list[Any]] = []
        self.data: list[memoryview] = []
        self.size = 0

    def ref(self, array: Any) -> Any:
        if array is None:
            return None
        if isinstance(array, (tuple, list)):
            return [self.ref(a) for a in array]
        array = np.ascontiguousarray(array)
        self.described.append([array.dtype.name, list(array.shape), self.size])
        view = memoryview(array.reshape(-1).view(np.uint8))
        self.data.append(view)
        self.size += view.nbytes
        return {"array": len(self.described) - 1}


class WriterProcess:
    """`Writer`'s appending calls, run by a child process (module docstring). Arguments as
    `Writer`'s; the child opens the file when the first request arrives."""

    def __init__(self) -> None:
        """Start the child (it imports numpy and kvformat while the caller goes on); `open`
        names the file."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = f"import sys; sys.path.insert(0, {root!r}); from kvformat.writer_process import serve; serve()"
        self._child = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches the parent, which closes the file
        )
        assert self._child.stdin is not None and self._child.stdout is not None
        self._out, self._in = self._child.stdin.fileno(), self._child.stdout.fileno()
        self._ops: list[list[Any]] = []
        self._arrays = _Arrays()
        self._closed = False
        self.path = ""
        self.durable = True

    def open(
        self,
        path: str | os.PathLike[str],
        layers: Sequence[LayerSpec | None],
        *,
        num_seqs: int = 1,
        metadata: dict[str, Any] | None = None,
        codec: str = "raw",
        durable: bool = True,
        overwrite: bool = False,
    ) -> None:
        """`Writer`'s arguments; the child opens the file with the next request."""
        self.path, self.durable = os.fspath(path), durable
        specs = [None if spec is None else spec.to_json() for spec in layers]
        options = {"num_seqs": num_seqs, "metadata": metadata, "codec": codec, "durable": durable}
        self._ops.append(["open", self.path, specs, {**options, "overwrite": overwrite}])

    # -- queued calls ---------------------------------------------------------------------
    def drop(self, layer: int, start: int, stop: int, seq: int = 0) -> None:
        self._ops.append(["drop", layer, start, stop, seq])

    def append_many(self, appends: Iterable[tuple[int, Any, Any, Any, int]]) -> None:
        """`Writer.append_many`; a call of more than `FLUSH_BYTES` goes to the child in parts
        of about that size (so the child never holds a copy of a whole large cache), each
        checked and written before the next is sent."""
        items: list[list[Any]] = []
        for layer, k, v, positions, seq in appends:
            ref = self._arrays.ref
            items.append([layer, ref(k), ref(v), ref(positions), seq])
            if self._arrays.size >= FLUSH_BYTES:
                self._ops.append(["append_many", items])
                self._request()
                items = []
        if items:
            self._ops.append(["append_many", items])

    def append_queries(self, layer: int, q: Any, positions: Any = None, seq: int = 0) -> None:
        self._ops.append(["append_queries", layer, self._arrays.ref(q), self._arrays.ref(positions), seq])

    def append_selection(self, layer: int, chosen: Any, positions: Any = None, seq: int = 0) -> None:
        ref = self._arrays.ref
        self._ops.append(["append_selection", layer, ref(chosen), ref(positions), seq])

    # -- calls that wait for the child ----------------------------------------------------
    def snapshot(
        self, metadata: dict[str, Any] | None = None, arrays: dict[str, Any] | None = None, sync: str = "none"
    ) -> int:
        """`Writer.snapshot`, then ``sync`` of what was written (``"fdatasync"``, ``"writeback"``
        (start the kernel writing it), ``"none"``); returns the snapshot's index."""
        named = {name: self._arrays.ref(array) for name, array in (arrays or {}).items()}
        self._ops.append(["snapshot", metadata, named, sync])
        return int(self._request())

    def close(self, metadata: dict[str, Any] | None = None) -> None:
        """`Writer.close`: the index written, the file in place; the child exits."""
        if self._closed:
            return
        self._ops.append(["close", metadata])
        try:
            self._request()
        finally:
            self._finish()

    def leave_partial(self) -> None:
        """Stop without an index (what was written stays in the ``.partial`` file); a child
        that opened no file just exits."""
        if self._closed:
            return
        self._ops = [["leave_partial"]]
        self._arrays = _Arrays()
        try:
            self._request()
        except (WriterProcessError, OSError):
            pass  # the child is gone already: what it wrote stays as it is
        finally:
            self._finish()

    def _request(self) -> Any:
        try:
            text = dumps({"ops": self._ops, "arrays": self._arrays.described})
        except InvalidLayoutError:  # metadata that is not plain JSON, refused as `Writer` does
            self._ops.pop()  # the call that brought it is undone; what came before stays queued
            raise
        arrays = self._arrays
        self._ops, self._arrays = [], _Arrays()
        try:
            _send(self._out, text, arrays.data)
            reply = _receive(self._in)
        except (BrokenPipeError, EOFError) as exc:
            raise WriterProcessError(f"the writer process stopped ({self._status()}): {exc}") from None
        if reply is None:
            raise WriterProcessError(f"the writer process stopped ({self._status()})")
        answer, _ = reply
        if "error" in answer:
            raise _error(*answer["error"])
        return answer["ok"]

    def _status(self) -> str:
        code = self._child.poll()
        return "still running" if code is None else f"exit code {code}"

    def _finish(self) -> None:
        self._closed = True
        for stream in (self._child.stdin, self._child.stdout):
            if stream is not None:
                stream.close()
        self._child.wait()


def _error(name: str, message: str, errno: int | None) -> BaseException:
    """The exception the child raised, rebuilt: kvformat's by class, ``OSError`` and its
    subclasses with their errno, anything else as `WriterProcessError`."""
    known = {c.__name__: c for c in _subclasses(kv_errors.KVSnapError)}
    if name in known:
        return known[name](message)
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, OSError):
        return cls(errno, message) if errno is not None else cls(message)
    return WriterProcessError(f"{name}: {message}")


def _subclasses(cls: type[BaseException]) -> list[type[BaseException]]:
    found: list[type[BaseException]] = [cls]
    for sub in cls.__subclasses__():
        found += _subclasses(sub)
    return found


# -- the child ----------------------------------------------------------------------------
def serve() -> None:
    """The child's loop: read requests from stdin, run them on one `Writer`, reply on stdout.
    At end of input with the file still open, the ``.partial`` file is left as written."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # a stray print cannot reach the reply pipe
    writer: Writer | None = None
    failed = False
    while True:
        message = _receive(requests)
        if message is None:  # the parent is gone
            if writer is not None:
                writer.__exit__(RuntimeError, None, None)
            return
        request, data = message
        arrays = [
            np.frombuffer(data, numpy_dtype(dtype), int(np.prod(shape)), offset).reshape(shape)
            for dtype, shape, offset in request["arrays"]
        ]
        result: Any = None
        try:
            for op in request["ops"]:
                if op[0] == "leave_partial":
                    if writer is not None:
                        writer.__exit__(RuntimeError, None, None)
                    _send(replies, {"ok": None})
                    return
                if failed:
                    raise WriterProcessError("an earlier request failed")
                if op[0] == "open":
                    writer = _open(op[1], op[2], op[3])
                    continue
                assert writer is not None
                result = _run(writer, op, arrays)
                if op[0] == "close":
                    _send(replies, {"ok": None})
                    return
        except Exception as exc:  # reported to the parent, which raises it
            failed = True
            _send(replies, {"error": [type(exc).__name__, _message(exc), getattr(exc, "errno", None)]})
            continue
        _send(replies, {"ok": result})


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename!r}" if exc.filename else "")
    return str(exc)


def _open(path: str, specs: list[Any], options: dict[str, Any]) -> Writer:
    layers = [None if spec is None else parse_layer(spec, i) for i, spec in enumerate(specs)]
    return Writer(path, layers, **options)


def _run(writer: Writer, op: list[Any], arrays: list[np.ndarray]) -> Any:
    def value(ref: Any) -> Any:
        if isinstance(ref, list):
            return tuple(value(r) for r in ref)
        return arrays[ref["array"]] if isinstance(ref, dict) else ref

    name = op[0]
    if name == "drop":
        writer.drop(op[1], op[2], op[3], seq=op[4])
    elif name == "append_many":
        writer.append_many([(layer, value(k), value(v), value(p), seq) for layer, k, v, p, seq in op[1]])
    elif name == "append_queries":
        writer.append_queries(op[1], value(op[2]), value(op[3]), seq=op[4])
    elif name == "append_selection":
        writer.append_selection(op[1], value(op[2]), value(op[3]), seq=op[4])
    elif name == "snapshot":
        index = writer.snapshot(op[1], arrays={k: value(v) for k, v in op[2].items()})
        if writer.durable:
            sync(writer.fileno(), op[3])
        return index
    elif name == "close":
        writer.close(op[1])
    else:
        raise WriterProcessError(f"unknown request {name!r}")
    return None


def sync(fd: int, mode: str) -> None:
    """What a snapshot does for durability while generation goes on: ``"writeback"`` starts
    the kernel writing it to disk without waiting (``posix_fadvise(DONTNEED)``), ``"fdatasync"``
    waits until it is on disk, ``"none"`` leaves it all to close."""
    if mode == "fdatasync":
        getattr(os, "fdatasync", os.fsync)(fd)  # macOS has no fdatasync
    elif mode == "writeback" and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
