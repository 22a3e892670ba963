"""The mlx backend's pipeline: pieces of many accumulators batched per device call, copied while
the previous batch runs, fetched, and folded into the accumulators on a thread of their own."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from kvformat import KVSnapError
from kvformat.checksum import crc32c

from ..dependencies import mx
from . import mlx_fold
from .arrays import PIECE, bytes_of
from .mlx import Flags, piece_flags, piece_function, split_pieces, to_device
from .mlx_fold import piece_bins, to_host
from .mlx_sizing import batch_bytes
from .mlx_staging import Staging

if TYPE_CHECKING:
    from ..stats.sums import RunningSums


class _Batch:
    """Pieces of many accumulators sent to the device together: per group of pieces of one
    shape, dtype and selection, one call of the batched function on the pieces stacked on the
    device (each piece is copied to the device once, straight from the file's pages).

    Life: copied (`__init__`, on the driving thread: the copies into staging buffers start on the
    copy threads and run while the driver reads the next batch), launched (`launch`: waits for
    the copies, runs ``after`` (releasing the pages copied), starts the device), fetched (`fetch`:
    the driving thread waits for the device and copies the small results to the host), folded
    (`_fold_all`, on the pipeline's fold thread, batches in the order they were sent)."""

    def __init__(
        self,
        entries: list[tuple[RunningSums, np.ndarray, np.ndarray, Any]],
        folder: ThreadPoolExecutor,
        staging: Staging | None = None,
        after: list[Callable[[], None]] | None = None,
    ) -> None:
        self.folder = folder
        self.staging = staging
        self.after = after or []
        groups: dict[tuple[Any, str, Flags], list[int]] = {}
        for i, (acc, x, _, _) in enumerate(entries):
            groups.setdefault((x.shape, x.dtype.str, piece_flags(acc, x.shape[0])), []).append(i)
        self.entries = [(acc, x, pos) for acc, x, pos, _ in entries]
        self.groups = [(flags, members) for (_, _, flags), members in groups.items()]
        self.fills = [
            staging.start_fill([entries[i][1] for i in members], [entries[i][3] for i in members])
            if staging is not None
            else None
            for _, members in self.groups
        ]
        self.calls: list[tuple[list[int], dict[str, Any]]] = []
        self.buffers: list[Any] = []
        self._launched = False
        self._lock = threading.Lock()
        self._folded: Future[None] | None = None
        self._marks: list[Future[None]] = []  # done once this batch is folded (`Pipeline.mark`)
        self._settled = False
        self._error: BaseException | None = None  # why it was not folded
        for acc, _, _, _ in entries:
            acc.pending = self

    def launch(self) -> None:
        """Wait for the copies, release what they read, start the device (idempotent; on the
        driving thread)."""

        if self._launched:
            return
        self._launched = True
        entries = self.entries
        for (flags, members), fill in zip(self.groups, self.fills, strict=True):
            copy = False
            if fill is not None:
                buffer, stacked = fill.result()
                self.buffers.append(buffer)
                copy = fill.remote and stacked.dtype == mx.float32
            else:
                stacked = mx.stack([to_device(entries[i][1]) for i in members])
            inputs = [stacked]
            if flags[0]:  # the position bin of every row of every piece, (pieces, n) uint8
                inputs.append(mx.array(np.stack([piece_bins(entries[i][2]) for i in members])))
            outputs = piece_function(*flags, batched=True, copy=copy)(*inputs)
            self.calls.append((members, outputs))
        self.fills = []
        for after in self.after:
            after()
        self.after = []
        mx.async_eval([outputs for _, outputs in self.calls])

    def fetch(self) -> Future[None]:
        """Wait for the device, copy the results to the host and queue the folding on the fold
        thread (after the batches fetched before this one); returns the folding's future.
        Idempotent."""
        self.launch()
        with self._lock:
            if self._folded is None:
                results = [(members, to_host(outputs)) for members, outputs in self.calls]
                self.calls = []
                if self.staging is not None:  # the device has read them: free for the next batch
                    self.staging.give_back(self.buffers)
                self.buffers = []
                self._folded = self.folder.submit(self._fold_all, results)
            return self._folded

    def _fold_all(self, results: list[tuple[list[int], dict[str, np.ndarray]]]) -> None:
        # Group by group (pieces of one shape and selection), each group's pieces in order; an
        # accumulator's pieces all fall in one group (one shape per head), so each accumulator
        # sums its pieces in the order they were added.
        try:
            for members, host in results:
                mlx_fold.fold_checked([self.entries[i] for i in members], host)
            for acc, _, _ in self.entries:
                if acc.pending is self:
                    acc.pending = None
        except BaseException as exc:
            self.settle_marks(exc)
            raise
        self.settle_marks(None)

    def add_mark(self, mark: Future[None]) -> None:
        """Complete ``mark`` once this batch is folded (at once if it is)."""
        with self._lock:
            if not self._settled:
                self._marks.append(mark)
                return
        complete_mark(mark, self._error)

    def settle_marks(self, error: BaseException | None) -> None:
        """This batch is folded (``error``: or failed, or was dropped): complete its marks."""
        with self._lock:
            if self._settled:
                return
            self._settled, self._error = True, error
            marks, self._marks = self._marks, []
        for mark in marks:
            complete_mark(mark, error)

    def fold(self) -> None:
        """Everything of this batch folded in (and so every batch sent before it)."""
        self.fetch().result()

    settle = fold  # an accumulator's `Pending`


class PipelineAbandoned(KVSnapError, RuntimeError):
    """The pipeline stopped (after a failure) before this work was folded in."""


def complete_mark(mark: Future[None], error: BaseException | None) -> None:
    if mark.done():
        return
    if error is None:
        mark.set_result(None)
    else:
        mark.set_exception(error)


class Pipeline:
    """Batches the pieces a pass adds into device calls of about ``limit`` bytes of 16-bit values
    (`mlx_sizing.BATCH_MIB`; float32 rows: twice the bytes) (`_Batch`):
    one batch copied into staging buffers (copy threads) while the next is read, the one before
    it on the device, results folded into the accumulators on one fold thread (in order) while
    the device works on the next. A pass marks each layer's end (`mark`) rather than draining
    the pipeline there: the layer's rows are computed once its mark is done, while the next
    layers are read, copied and computed. Device memory: two batches' staging buffers
    (``2 x limit``, twice that for float32 rows; `flush`), one batch's float32 copies and
    outputs; host memory: the results of the batches waiting for the fold thread (a few vectors
    and a ``dim x dim`` matrix per piece)."""

    def __init__(
        self, limit: int | None = None, staging: bool = True, copy_threads: int | None = None
    ) -> None:
        self.limit = batch_bytes() if limit is None else limit
        self._staging = Staging.create(copy_threads) if staging else None
        self._entries: list[tuple[RunningSums, np.ndarray, np.ndarray, Any]] = []
        self._after: list[Callable[[], None]] = []
        self._bytes = 0
        self._copying: _Batch | None = None  # copies running while the next batch is read
        self._in_flight: _Batch | None = None  # on the device
        self._folder = ThreadPoolExecutor(1, thread_name_prefix="kvsnap-mlx-fold")
        self._folding: collections.deque[Future[None]] = collections.deque()
        self._marks: list[Future[None]] = []  # for the batch the queued pieces will form
        self._newest: _Batch | None = None

    def add(
        self,
        acc: RunningSums,
        rows: np.ndarray,
        positions: np.ndarray,
        after: Callable[[], None] | None = None,
        check: Any = None,
    ) -> None:
        """Queue ``rows`` of ``acc``; ``after`` runs once they are copied for the device (e.g.
        releasing their pages). ``check``: a `kvformat.PayloadCheck` the bytes of
        ``rows`` (a chunk's whole payload, read unchecked) must pass: the copy threads compute
        the CRC over what they copy, so the driving thread reads nothing itself (checked here
        instead when ``rows`` span several pieces or nothing is staged)."""
        acc.prepare_add()
        if check is not None and (rows.shape[0] > PIECE or self._staging is None):
            check.check(crc32c(bytes_of(rows)))
            check = None
        acc.add_added(rows, positions)
        for x, pos in split_pieces(rows, positions):
            self._entries.append((acc, x, pos, check))
            self._bytes += 2 * x.size  # as 16-bit values: float32 batches as many (`BATCH_MIB`)
        if after is not None:
            self._after.append(after)
        if self._bytes >= self.limit:
            self.flush()

    def flush(self) -> None:
        """Launch the batch copied before (its copies ran while this one was read), fetch the
        batch launched before that and queue its folding, then start copying what is queued.
        In that order: the fetched batch's staging buffers are free again and the launched
        batch's file pages released before this one's copies take a buffer and map pages, so
        a pass holds two batches' staging buffers and one batch's pages, not three and two."""
        launching, self._copying = self._copying, None
        if launching is not None:
            self._launch(launching)
        batch = _Batch(self._entries, self._folder, self._staging, self._after) if self._entries else None
        if batch is None:
            for after in self._after:
                after()
        else:
            self._newest = batch
            for mark in self._marks:
                batch.add_mark(mark)
            self._marks = []
        self._entries, self._after, self._bytes = [], [], 0
        self._copying = batch
        while len(self._folding) > 2:  # bounded host memory: results wait for the fold thread
            self._folding.popleft().result()

    def _launch(self, batch: _Batch) -> None:
        batch.launch()
        previous, self._in_flight = self._in_flight, batch
        if previous is not None:
            self._folding.append(previous.fetch())

    def mark(self) -> Future[None]:
        """A future done once everything added so far is folded into its accumulators (its
        exception: the fold's, or `PipelineAbandoned`). Unlike `finish` nothing waits: the pieces
        added next are read and copied while these are on the device (a pass marks each layer's
        end, and computes the layer's rows once its mark is done)."""
        mark: Future[None] = Future()
        if self._entries:
            self._marks.append(mark)
        elif self._newest is not None:
            self._newest.add_mark(mark)
        else:
            mark.set_result(None)
        return mark

    def wait(self, mark: Future[None]) -> None:
        """Until ``mark`` (`mark`) is done, its exception raised: the driving thread moves the
        batches on, oldest first, only as far as the mark needs (its pieces may still be queued,
        copying or on the device)."""
        while not mark.done():
            if self._folding:
                self._folding.popleft().result()
            elif self._in_flight is not None:
                self._folding.append(self._in_flight.fetch())
                self._in_flight = None
            elif self._copying is not None:
                batch, self._copying = self._copying, None
                self._launch(batch)
            elif self._entries:
                self.flush()
            else:
                break
        mark.result()

    def finish(self) -> None:
        """Send what is queued and fold everything: every accumulator is up to date."""
        self.flush()
        if self._copying is not None:
            batch, self._copying = self._copying, None
            self._launch(batch)
        if self._in_flight is not None:
            self._folding.append(self._in_flight.fetch())
            self._in_flight = None
        while self._folding:
            self._folding.popleft().result()
        self._newest = None  # folded, its marks done: its pieces (views of mapped files) can go

    def close(self) -> None:
        """Finish, then stop the fold thread."""
        try:
            self.finish()
        finally:
            self._folder.shutdown()
            if self._staging is not None:
                self._staging.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is None:
            self.close()
        else:  # a failure (a bad CRC, say)
            self.abandon()

    def abandon(self) -> None:
        """Stop without finishing what is queued (after a failure); marks not done yet fail with
        `PipelineAbandoned`."""
        self._folder.shutdown()
        if self._staging is not None:
            self._staging.close()
        dropped = PipelineAbandoned("the mlx pipeline stopped before this work was folded in")
        for mark in self._marks:
            complete_mark(mark, dropped)
        self._marks = []
        for batch in (self._copying, self._in_flight, self._newest):
            if batch is not None:
                batch.settle_marks(dropped)
