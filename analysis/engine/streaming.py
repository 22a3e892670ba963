"""The streaming pass: one read of a snapshot's chunks, spread over threads (or an mlx device),
feeding one `HeadAccumulator` per (layer, seq, head, tensor) and handing each layer's
accumulators back as soon as the pass is past it."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import kvformat
from kvformat import pages

from ..kernels import profile
from ..stats.rope import Rope
from . import processes
from .accumulator import HeadAccumulator
from .executors import OrderedPool, after
from .parallel import single_threaded_blas
from .plan import (
    CLOSING_LAYERS,
    Key,
    LayerResult,
    PassOptions,
    Window,
    add_segments,
    fresh_accumulators,
    head_batches,
    layer_bar,
    layer_ropes,
    layers_of_part,
    pass_order,
    row_parts,
)
from .rows import compute as compute_rows


class _Workers:
    """The threads of one pass: an `OrderedPool` of ``options.workers`` threads for the batches (each
    head's batches in order), BLAS on one thread (the Gram's rounding then does not depend on the
    thread count), and for mlx the device `Pipeline` plus CPU threads for the rows (``layers``:
    the layers the pass will close)."""

    def __init__(self, options: PassOptions, layers: int = 1) -> None:
        self.options = options
        self.layers = layers
        self.pipeline: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _Workers:
        with self._stack as stack:
            kernel = profile(self.options.backend)
            # The row threads stop after the pipeline (exits run in reverse): rows waiting for a
            # mark the pipeline drops after a failure then end with its error.
            share = self.options.device_share  # processes driving the device with passes like this
            self.row_threads = kernel.row_threads(share)
            self.row_pool = stack.enter_context(
                ThreadPoolExecutor(self.row_threads, thread_name_prefix="kvsnap-rows")
            )
            pipeline = kernel.pipeline(share, worker=share > 1)
            if pipeline is not None:
                self.pipeline = stack.enter_context(pipeline)
            stack.enter_context(single_threaded_blas())
            self.pool = stack.enter_context(OrderedPool(self.options.workers))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(*exc)  # type: ignore[arg-type]

    def add(
        self,
        snap: kvformat.Snapshot,
        batch: list[kvformat.Segment],
        accumulators: dict[Key, HeadAccumulator],
        rope: Rope | None,
        release_each: bool = True,
    ) -> Future[Any]:
        """Read and add one batch of one head's segments (K un-rotated by ``rope`` when given)
        on a worker; the reads run there too, so checksums and page faults use every core."""
        first = batch[0]
        k_acc = accumulators[(first.layer, first.seq, first.head, "k")]
        v_acc = accumulators[(first.layer, first.seq, first.head, "v")]
        pages.of(snap).prefetch(batch)
        key = (first.layer, first.seq, first.head)
        return self.pool.submit(
            key, add_segments, snap, batch, k_acc, v_acc, rope, self.pipeline, release_each
        )

    def finish_layer(self, layer: _OpenLayer, rows: bool) -> None:
        """After a layer's last batch: add the work that completes it to ``layer.work``. On mlx,
        the device pipeline's mark of the layer's end (``layer.mark``; nothing waits: the next
        layer is read and copied while this one is on the device) and, with ``rows``, the
        layer's rows computed once the mark is done, stacked in one run (`rows.compute`), the
        layers spread over the row threads; a layer is cut into runs only where the pass has
        fewer layers than row threads. Most of a row thread's time goes to waiting for the
        interpreter's lock between numpy calls (LAPACK runs without it), and a whole layer's
        stack makes a quarter of the calls of four quarter-layer runs: on the accelerator
        machine's bf16 file the warm one-process pass took 1.12-1.23x less time so
        (the benchmarks in `benchmarks/`). On the CPU, with ``rows``, each row computed on the threads
        after its head's batches; on one thread (a batch's file, ``--jobs 1``) the layer's rows
        in one stacked run, whose eigenvalues the C solver takes four at a time."""
        accumulators = layer.accumulators
        if self.pipeline is not None:
            mark = layer.mark = self.pipeline.mark()
            layer.work.append(mark)
            if rows:
                runs = -(-self.row_threads // max(1, self.layers))
                layer.work += [
                    self.row_pool.submit(after, mark, compute_rows, part)
                    for part in row_parts(list(accumulators.values()), runs)
                ]
        elif rows and self.pool.threads == 1:  # its adds already ran, in this thread: one stacked run
            layer.work.append(self.pool.submit(None, compute_rows, list(accumulators.values())))
        elif rows:
            layer.work += [self.pool.submit(key[:3], acc.row_arrays) for key, acc in accumulators.items()]

    def wait(self, layer: _OpenLayer) -> None:
        """Until ``layer``'s work is done (its first exception raised); on mlx, driving the
        device pipeline as far as the layer's mark needs."""
        if layer.mark is not None and self.pipeline is not None:
            self.pipeline.wait(layer.mark)
        for future in layer.work:
            future.result()

    def drain(self) -> None:
        """Every batch added and, on mlx, folded."""
        self.pool.drain()
        if self.pipeline is not None:
            self.pipeline.finish()


@dataclass
class _OpenLayer:
    """A layer the pass has started: its accumulators and the work submitted for it."""

    accumulators: dict[Key, HeadAccumulator]
    work: list[Future[Any]] = field(default_factory=list)
    mark: Future[None] | None = None  # mlx: done once the device pipeline has folded the layer


def layers(
    path: str | os.PathLike[str], options: PassOptions, progress: bool = False, finish: bool = False
) -> Iterator[LayerResult]:
    """One streaming pass over a file, yielding each layer's accumulators as soon as the pass is
    past the layer's last chunk and its work is done, so memory holds the accumulators of the
    layers in progress only (one or two for a layer-major file).

    With ``options.workers`` = T > 1, a local file goes to T worker processes on the CPU
    backend, `kernels.mlx_sizing.processes` (T) on mlx (`engine.processes`, which reads it in
    the same batches). Otherwise (a URL, a small file; on mlx one thread drives the device)
    consecutive blocks of a head (up to 8 MiB of K and V, or one block if larger) go to T
    threads as one task, at most T + 2 such batches in flight
    (`analysis.engine.executors.OrderedPool`): memory is about ``(T + 3) x max(8 MiB, block) + T x 3 x
    2048 x head_dim x 4 bytes (float32 work buffers) + the accumulators of the layers in progress``
    (each ``~(head_dim^2 + 6 head_dim) x 8 + 36 KiB``). Where segments are small (a series
    of snapshots), the pass takes them head by head within windows of `WINDOW_BYTES` of the file
    (`windows`) and a head's small segments are read and added together (up to 8192 rows, one
    copy); a window's mapped pages are released once its work is done, so the resident file
    pages stay within about two windows. ``progress`` shows a bar per layer on
    stderr when it is a terminal; ``finish`` computes each accumulator's row (eigenvalues and
    all) on the threads, once its layer is read."""
    if processes.usable(path, options.workers, options.backend):
        yield from processes.layers(path, options, progress, finish)
        return
    if profile(options.backend).device:  # in this process, one thread drives the device
        options = dataclasses.replace(options, workers=1)
    with kvformat.open(path, options.snapshot, storage_options=options.storage_options) as snap:
        name, index = os.fspath(path), snap.index
        ropes = layers_of_part(layer_ropes(snap, options.keys), options.part)
        order, last = pass_order(snap, ropes)
        bar = layer_bar(name, len(ropes), progress)
        for layer in ropes:
            if layer not in last:  # present but holding no tokens
                bar.update()
                yield name, index, layer, fresh_accumulators(snap, layer, ropes[layer], options)
        yield from _streamed(snap, name, options, ropes, (order, last), bar, finish)


def _streamed(
    snap: kvformat.Snapshot,
    name: str,
    options: PassOptions,
    ropes: dict[int, Any],
    plan: tuple[list[Window], dict[int, Any]],
    bar: Any,
    finish: bool,
) -> Iterator[LayerResult]:
    """`layers`' threads at work: ``plan`` (`pass_order`: the windows in order and each layer's
    last) read batch by batch, each layer yielded once past its last chunk and its work done."""
    order, last = plan
    index, unrotate = snap.index, options.keys == "pre_rope"
    regrouped = any(w.release for w in order)  # small segments: released by window
    started: dict[int, _OpenLayer] = {}
    closing: collections.deque[int] = collections.deque()
    in_flight: collections.deque[Future[Any]] = collections.deque()

    def finished(workers: _Workers, keep: int) -> Iterator[LayerResult]:
        """The closed layers whose work is done, in order, waiting for the oldest until at
        most ``keep`` closed layers are left."""
        while closing and (len(closing) > keep or all(f.done() for f in started[closing[0]].work)):
            layer = closing.popleft()
            done = started.pop(layer)
            workers.wait(done)
            bar.update()
            yield name, index, layer, done.accumulators

    # Windows of small segments whose pages are released once their work is done.
    releasing: collections.deque[tuple[Window, list[Future[Any]]]] = collections.deque()
    window_work: list[Future[Any]] = []

    with _Workers(options, len(last)) as workers, bar:
        for batch, closes, window_end in head_batches(snap, order, last):
            layer = batch[0].layer
            if layer not in started:
                started[layer] = _OpenLayer(fresh_accumulators(snap, layer, ropes[layer], options))
            open_layer = started[layer]
            rope = ropes[layer] if unrotate else None
            future = workers.add(snap, batch, open_layer.accumulators, rope, not regrouped)
            open_layer.work.append(future)
            in_flight.append(future)
            window_work.append(future)
            if window_end is not None:
                if window_end.release:
                    releasing.append((window_end, window_work))
                window_work = []
            _release(snap, releasing, wait=False)
            if closes:
                workers.finish_layer(open_layer, finish)
                closing.append(layer)
            while len(in_flight) > options.workers + 2:
                in_flight.popleft().result()
            yield from finished(workers, keep=CLOSING_LAYERS)
        workers.drain()
        _release(snap, releasing, wait=True)
        yield from finished(workers, keep=0)


def _release(
    snap: kvformat.Snapshot, releasing: collections.deque[tuple[Window, list[Future[Any]]]], wait: bool
) -> None:
    """Release the mapped pages of the windows in ``releasing`` whose work is done (``wait``: of
    all of them, waiting for their work), oldest first."""
    while releasing and (wait or all(f.done() for f in releasing[0][1])):
        window, work = releasing.popleft()
        for future in work:
            future.result()
        pages.of(snap).release(window.segments)


def accumulate(path: str | os.PathLike[str], options: PassOptions) -> dict[Key, HeadAccumulator]:
    """One streaming pass over a file: the accumulator of every key."""
    table: dict[Key, HeadAccumulator] = {}
    for _, _, _, accumulators in layers(path, options):
        table.update(accumulators)
    return table
