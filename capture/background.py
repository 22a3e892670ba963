"""Snapshots leave the generating thread at once: device slices are packed and evaluated
asynchronously there, and a writer thread copies them to the host, checksums and writes them.

Memory is bounded: at most ``max_pending`` snapshots wait in the queue (each holds what it adds:
its new rows on the device or in host memory, about ``layers x 2 x heads x new tokens x head_dim x
itemsize`` bytes); when the queue is full the generator waits for the disk. A writer error (disk
full, permission) is kept and raised in the generating thread at its next call, never swallowed,
and the ``.partial`` file stays recoverable.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Collection
from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np

from kvformat.errors import InvalidArgumentError

from . import gather
from .errors import CaptureError
from .gather import Rows

DEFAULT_MAX_PENDING = 4


class Transfer:
    """mlx arrays (or `gather.Rows` of cache buffers) copied on the device into one flat buffer per
    dtype and evaluated without waiting; `to_host` returns numpy copies of the original shapes (in
    the original order).

    Arrays of one shape (a snapshot's K/V deltas: every layer's ``(batch, heads, new, dim)``)
    are joined by one ``mx.concatenate`` along their first axis, which reads strided slices of
    the cache directly; flattening each first would copy every strided slice once more. On CUDA
    every input of a concatenation is a copy kernel launched from the generating thread
    (the benchmarks in `benchmarks/`); `Rows` of one buffer shape and span are instead copied by
    `gather.rows`, 64 buffers a launch."""

    def __init__(self, arrays: list[mx.array | Rows], fresh: Collection[int] = ()) -> None:
        """``fresh``: the indices of arrays that are buffers of their own, made for this snapshot
        and never a view of a cache (the joined queries, the logits): each is transferred as it
        is, not copied into a joined buffer once more."""
        groups: dict[Any, dict[tuple[Any, ...], list[int]]] = {}
        for index, array in enumerate(arrays):
            key = _group(array)
            groups.setdefault(array.dtype, {}).setdefault(key, []).append(index)
        # (flat, offset, size, shape) of each array: the writer thread slices without numpy calls
        self._places: list[tuple[int, int, int, tuple[int, ...]]] = [(0, 0, 0, ())] * len(arrays)
        self._flats: list[mx.array] = []
        self._bfloat16: list[bool] = []
        for dtype, by_shape in groups.items():
            lone: list[int] = []
            for members in by_shape.values():
                shape = tuple(arrays[members[0]].shape)
                if len(members) > 1 and shape:
                    self._add(_join([arrays[i] for i in members]), members, shape)
                    continue
                for i in members:
                    if i in fresh:
                        self._add(_array(arrays[i]).reshape(-1), [i], shape)
                    else:
                        lone.append(i)
            if lone:
                # Always a new buffer (a lone array might otherwise be a view of the cache, whose
                # rotating slots are overwritten later).
                parts = [_array(arrays[i]).reshape(-1) for i in lone]
                offset = 0
                for i in lone:
                    size = math.prod(arrays[i].shape)
                    self._places[i] = (len(self._flats), offset, size, tuple(arrays[i].shape))
                    offset += size
                self._append(mx.concatenate([*parts, mx.zeros((0,), dtype)]))
        mx.async_eval(self._flats)
        self.nbytes = sum(f.nbytes for f in self._flats)

    def _add(self, flat: mx.array, members: list[int], shape: tuple[int, ...]) -> None:
        """``flat``: the arrays ``members`` of one ``shape``, one after another."""
        size = math.prod(shape)
        for j, i in enumerate(members):
            self._places[i] = (len(self._flats), j * size, size, shape)
        self._append(flat)

    def _append(self, flat: mx.array) -> None:
        # bfloat16 leaves as uint16, viewed here: the writer thread adds nothing to mlx's graph,
        # and its host copy is a plain 2-byte copy
        bfloat16 = flat.dtype == mx.bfloat16
        self._bfloat16.append(bfloat16)
        self._flats.append(flat.view(mx.uint16) if bfloat16 else flat)

    def to_host(self) -> list[np.ndarray]:
        """Host copies (numpy copies release the GIL; on CUDA they fault mlx's managed pages in
        here, on the writer thread, not on the generating one)."""
        hosts = [np.array(np.asarray(flat), copy=True) for flat in self._flats]
        hosts = [
            h.view(ml_dtypes.bfloat16) if bf16 else h for h, bf16 in zip(hosts, self._bfloat16, strict=True)
        ]
        self._flats = []
        return [
            hosts[flat][offset : offset + size].reshape(shape) for flat, offset, size, shape in self._places
        ]


def _group(array: mx.array | Rows) -> tuple[Any, ...]:
    """What `Transfer` joins by: an array's shape; rows' buffer shape and span."""
    if isinstance(array, Rows):
        return ("rows", tuple(array.buffer.shape), array.start, array.count)
    return tuple(array.shape)


def _join(group: list[mx.array | Rows]) -> mx.array:
    """Items of one shape (`_group`) one after another along their first axis, flat, in a buffer of
    their own: `Rows` of one span by `gather.rows` (one launch per 64 buffers on CUDA), arrays by
    one ``mx.concatenate`` (contiguous, so the flat view is free)."""
    spans = [item for item in group if isinstance(item, Rows)]
    if len(spans) == len(group):
        return gather.rows([span.buffer for span in spans], spans[0].start, spans[0].count).reshape(-1)
    return mx.concatenate([_array(item) for item in group], axis=0).reshape(-1)


def _array(array: mx.array | Rows) -> mx.array:
    return array.array() if isinstance(array, Rows) else array


class BackgroundWriter:
    """One writer thread fed through a bounded queue of jobs (callables run in order)."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise InvalidArgumentError("max_pending must be at least 1")
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None  # the first failure; kept, so later jobs are dropped
        self._reported = False
        self._thread = threading.Thread(target=self._work, name="kvsnap-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None:  # after a failure, later jobs are dropped
                    job()
            except BaseException as exc:
                self._error = exc
            finally:
                self._queue.task_done()

    def check(self) -> None:
        """Raise the writer thread's error, if it had one (once; jobs stay dropped after it)."""
        if self._error is not None and not self._reported:
            self._reported = True
            raise CaptureError(f"writing snapshots failed: {self._error}") from self._error

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; waits while ``max_pending`` jobs are queued."""
        if self._closed:
            raise CaptureError("the snapshot writer is closed")
        self.check()
        self._queue.put(job)

    def drain(self) -> None:
        """Wait until every queued job ran; raise the first error."""
        self._queue.join()
        self.check()

    def close(self) -> None:
        """Finish every queued job and stop the thread; raise the first error."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self.check()
