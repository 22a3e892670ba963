"""Staging buffers for the mlx backend: host rows copied by a few threads into buffers the device
reads (CUDA managed memory placed on the host or the GPU, `unified_memory`; plain mlx arrays
elsewhere), with the CRC of what was copied computed on the way."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat.checksum import concatenated_linear, linear_crc, zeros_crc
from kvformat.errors import InvalidArgumentError

from ..dependencies import mx
from . import unified_memory
from .arrays import bytes_of
from .mlx_sizing import copy_threads

PLACEMENT = "host"
"""Where staging buffers live on CUDA (`unified_memory.MODES`; ``KVSNAP_MLX_STAGING`` overrides):
in host memory, the device reading them in place: faster than the driver's default (``fault``:
pages moved on demand, both ways, at each reuse) and than ``prefetch`` or ``mostly``
(`benchmarks/mlx_copy_bench.py` prints the figures)."""


def on_cuda() -> bool:
    """Whether mlx computes on a CUDA device here."""

    cuda = getattr(mx, "cuda", None)
    return cuda is not None and bool(cuda.is_available()) and mx.default_device() == mx.gpu


class Staging:
    """Device buffers the host writes batches into, on many threads.

    ``mx.array(rows)`` copies on one thread, holding the GIL. An evaluated mlx array exposes its
    memory through the buffer protocol (CUDA managed memory, or Apple's unified memory), so the
    pieces of a batch are copied straight into it with ``np.copyto`` on a thread pool (which
    releases the GIL; a pass uses `copy_threads`).
    Buffers are reused once the device has read them (`give_back`); at most three per shape are
    kept (a batch copying, one on the device, one being fetched). `create` checks once that a
    write through the buffer is what the device reads, and returns None where it is not (then
    batches go through ``mx.array``).

    On CUDA that memory is managed memory, and by default its pages move on demand: the device
    faults each batch in, the host faults it back at its next write. ``placement`` (`PLACEMENT`)
    keeps the buffers in host memory instead, the device reading them in place over the bus
    (`unified_memory`; both measured by `benchmarks/mlx_copy_bench.py`). Float32 rows are
    then copied to device memory once per call (`piece_function` ``copy``); 16-bit rows already
    are, by their conversion."""

    KEEP_BYTES = 256 << 20

    def __init__(self, threads: int, placement: str | None = None) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvsnap-mlx-copy")
        self.threads = threads
        self.free: dict[tuple[tuple[int, ...], str], list[Any]] = {}  # (shape, dtype name)
        self.placement = placement or os.environ.get("KVSNAP_MLX_STAGING", PLACEMENT)
        if self.placement not in unified_memory.MODES:
            raise InvalidArgumentError(
                f"KVSNAP_MLX_STAGING={self.placement!r}: one of {', '.join(unified_memory.MODES)}"
            )
        self.memory = unified_memory.UnifiedMemory.load() if self.placement != "fault" and on_cuda() else None
        self.managed: dict[int, bool] = {}  # buffer address: in managed memory (hints set)

    @classmethod
    def create(cls, threads: int | None = None) -> Staging | None:

        try:
            probe = mx.zeros((64,), dtype=mx.float32)
            mx.eval(probe)
            view = host_view(probe)
            if not view.flags.writeable or view.shape != (64,):
                return None
            view[:] = np.arange(64, dtype=np.float32)
            if float(np.array((probe * 2).sum())) != float(np.arange(64).sum() * 2):
                return None
        except (TypeError, ValueError, BufferError, RuntimeError):
            return None
        return cls(threads or copy_threads())

    def _take(self, shape: tuple[int, ...], dtype: Any) -> Any:

        free = self.free.get((shape, str(dtype)))
        if free:
            return free.pop()
        buffer = mx.zeros(shape, dtype=dtype)
        mx.eval(buffer)
        if self.memory is not None:
            address = host_view(buffer).ctypes.data
            managed = self.managed[address] = self.memory.is_managed(address)
            if managed:
                try:
                    self.memory.place(address, buffer.nbytes, self.placement)
                except unified_memory.UnifiedMemoryError as exc:
                    self._give_up(exc)
        return buffer

    def _give_up(self, error: Exception) -> None:
        """A placement hint failed: the pass goes on without hints (they only move pages)."""
        warnings.warn(f"mlx staging placement {self.placement!r} off: {error}", RuntimeWarning, stacklevel=3)
        self.memory = None
        self.managed.clear()

    def fill(self, pieces: list[np.ndarray]) -> tuple[Any, Any]:
        """``(buffer, stacked)``: ``pieces`` (same shape and dtype) copied into one device buffer
        ``(len(pieces), *shape)``; ``stacked`` is it in the pieces' type (16-bit types stay 16-bit:
        the device converts)."""
        return self.start_fill(pieces).result()

    def start_fill(self, pieces: list[np.ndarray], checks: list[Any] | None = None) -> _Fill:
        """`fill`, started: the copies run on the copy threads; ``.result()`` waits for them.
        ``checks``: per piece, None or a `kvformat.PayloadCheck` its bytes must pass; the
        copy threads compute the CRC of what they copy (the linear CRC of each task's rows,
        combined per piece by `kvformat.checksum`), ``.result()`` checks it."""

        first = pieces[0]
        sixteen = first.dtype.name in ("bfloat16", "float16")
        shape = (len(pieces), *first.shape)
        buffer = self._take(shape, mx.uint16 if sixteen else mx.float32)
        target = host_view(buffer)
        rows = first.shape[0]
        step = max(1, -(-rows * len(pieces) // (self.threads * 2)))  # ~2 tasks per thread
        checks = checks or [None] * len(pieces)

        def copy(index: int, start: int) -> int:
            source = pieces[index][start : start + step]
            if sixteen:
                np.copyto(target[index, start : start + step], source.view(np.uint16))
            else:
                np.copyto(target[index, start : start + step], source, casting="unsafe")
            return linear_crc(bytes_of(source)) if checks[index] is not None else 0

        tasks = [(i, start) for i in range(len(pieces)) for start in range(0, rows, step)]
        copies = [self.pool.submit(copy, i, start) for i, start in tasks]
        task_bytes = [min(step, rows - start) * first[0].nbytes for _, start in tasks]
        verify = _CopyCheck(checks, [i for i, _ in tasks], task_bytes)
        stacked = buffer
        if first.dtype.name == "bfloat16":
            stacked = buffer.view(mx.bfloat16)
        elif first.dtype == np.float16:
            stacked = buffer.view(mx.float16)
        address = target.ctypes.data
        managed = self.managed.get(address, False)
        prefetch = self.memory if managed and self.placement in ("prefetch", "mostly") else None
        remote = managed and self.placement == "host"
        return _Fill(copies, buffer, stacked, verify, prefetch, address, remote)

    def give_back(self, buffers: list[Any]) -> None:
        """Buffers the device has finished reading: kept for reuse, at most three per shape and
        `KEEP_BYTES` in all (the rest are freed)."""
        for buffer in buffers:
            kept = self.free.setdefault((tuple(buffer.shape), str(buffer.dtype)), [])
            held = sum(b.nbytes for free in self.free.values() for b in free)
            if len(kept) < 3 and held + buffer.nbytes <= self.KEEP_BYTES:
                kept.append(buffer)
            else:
                self._release(buffer)

    def _release(self, buffer: Any) -> None:
        """Clear the placement hints of a buffer about to be freed: mlx reuses freed memory for
        its own arrays, which belong in device memory."""
        if self.memory is not None:
            address = host_view(buffer).ctypes.data
            if self.managed.pop(address, False):
                try:
                    self.memory.unplace(address, buffer.nbytes, self.placement)
                except unified_memory.UnifiedMemoryError as exc:
                    self._give_up(exc)

    def close(self) -> None:
        self.pool.shutdown()
        for free in self.free.values():
            for buffer in free:
                self._release(buffer)
        self.free.clear()


@dataclass
class _CopyCheck:
    """The payload checks of the pieces of one fill: per piece its check (or None); per copy
    task, its piece and bytes, in order."""

    checks: list[Any]
    task_piece: list[int]
    task_bytes: list[int]

    def check(self, parts: list[int]) -> None:
        """Raise `kvformat.ChecksumError` for the first piece whose tasks' linear CRCs
        (``parts``, per task) do not combine to its payload's CRC."""
        pieces: dict[int, list[tuple[int, int]]] = {}
        for piece, nbytes, part in zip(self.task_piece, self.task_bytes, parts, strict=True):
            if self.checks[piece] is not None:
                pieces.setdefault(piece, []).append((nbytes, part))
        for piece, spans in pieces.items():
            crc = concatenated_linear(spans) ^ zeros_crc(sum(nbytes for nbytes, _ in spans))
            self.checks[piece].check(crc)


@dataclass
class _Fill:
    """Copies into a staging buffer in progress: `result` waits for them (and raises what one of
    them raised, or a payload CRC that does not match), then gives ``(buffer, stacked)``."""

    copies: list[Future[int]]
    buffer: Any
    stacked: Any
    verify: _CopyCheck | None = None
    prefetch: Any = None  # a `unified_memory.UnifiedMemory` that moves the buffer to the device
    address: int = 0
    remote: bool = False  # the device reads the buffer in host memory, over the bus

    def result(self) -> tuple[Any, Any]:
        parts = [future.result() for future in self.copies]
        if self.verify is not None:
            self.verify.check(parts)
            self.verify = None
        if self.prefetch is not None:
            try:
                self.prefetch.prefetch(self.address, self.buffer.nbytes)
            except unified_memory.UnifiedMemoryError as exc:  # a hint: the device faults the pages in
                warnings.warn(f"mlx staging prefetch off: {exc}", RuntimeWarning, stacklevel=2)
            self.prefetch = None
        return self.buffer, self.stacked


def host_view(array: Any) -> np.ndarray:
    """The memory of an evaluated mlx array as a numpy array (no copy where mlx allows it)."""
    return np.asarray(memoryview(array))
