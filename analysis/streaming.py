"""The streaming pass: one read of a snapshot's chunks, spread over threads (or an mlx device),
feeding one `HeadAccumulator` per (layer, seq, head, tensor) and handing each layer's
accumulators back as soon as the pass is past it."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import kvformat
from kvformat.checksum import crc32c

from .accumulator import HeadAccumulator, bytes_of, stack
from .catalogue import ALL, stat_groups
from .parallel import after
from .rope import Rope
from .rows import compute as compute_rows

BATCH_BYTES = 8 << 20  # K + V bytes of one head handed to one task
SMALL_SEGMENT_BYTES = 1 << 20  # segments smaller than this on average are regrouped by head ...
WINDOW_BYTES = 64 << 20  # ... within windows of this many K + V bytes in file order
CLOSING_LAYERS = 8
"""Layers past their last chunk whose work (device folds, rows) may still run while the pass reads
on; at more, it waits for the oldest (their accumulators stay in memory meanwhile)."""


Key = tuple[int, int, int, str]  # (layer, seq, head, "k" | "v"): the order of series keys


@dataclass(frozen=True)
class PassOptions:
    """What one streaming pass over a file computes, and with how many workers.

    ``snapshot``: index (negative from the end); ``keys``: ``"post_rope"`` or ``"pre_rope"``;
    ``stats``: the statistic groups (`GROUPS`); ``workers``: workers on this file's heads
    (processes for a local file, `analysis.processes`; threads for a URL or a small file);
    ``storage_options``: fsspec options for URLs; ``progress``: a bar of layers on stderr;
    ``backend``: ``"cpu"`` (the compiled kernel) or ``"mlx"`` (mlx on its default device: a local
    file on `mlx_kernel.processes` worker processes, each driving the device; else one thread
    that reads the next block while the device works)."""

    snapshot: int = -1
    keys: str = "post_rope"
    stats: frozenset[str] = ALL
    workers: int = 1
    storage_options: dict[str, Any] | None = field(default=None, compare=False)
    progress: bool = field(default=False, compare=False)  # a bar per layer on a terminal's stderr
    backend: str = "cpu"

    def __post_init__(self) -> None:
        if self.keys not in ("post_rope", "pre_rope"):
            raise ValueError("keys must be 'post_rope' or 'pre_rope'")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, not {self.workers!r}")
        check_backend(self.backend)
        object.__setattr__(self, "stats", stat_groups(self.stats))


BACKENDS = ("cpu", "mlx")


def check_backend(backend: str) -> None:
    """ValueError for an unknown backend, or ``"mlx"`` where mlx is not installed."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if backend == "mlx":
        from . import mlx_kernel

        if not mlx_kernel.available():
            raise ValueError("backend 'mlx' needs mlx: pip install 'kvsnap[capture]' (or mlx-cuda, mlx[cpu])")


def _add_segments(
    snap: kvformat.Snapshot,
    segments: list[kvformat.Segment],
    k_acc: HeadAccumulator,
    v_acc: HeadAccumulator,
    rope: Rope | None,
    pipeline: Any = None,
    release_each: bool = True,
) -> None:
    """Read (CRC, decode), add and release each segment of one head, in order; K is un-rotated
    by ``rope`` when given. Runs on a pass's worker thread: reading there spreads the page faults
    and checksums of a memory-mapped file over the cores. With an mlx ``pipeline``
    (`mlx_kernel.Pipeline`) the rows join its next device batch instead."""
    for group in _joined(segments):
        k_check = v_check = None
        if len(group) > 1:  # small segments of one head: read and added at once (one copy)
            block = snap.read_many(group)
        else:  # CRCs checked by the copy threads (mlx) or piece by piece as the kernel adds
            block, k_check, v_check = snap.read_unchecked(group[0])
        block_k, block_v, positions = block.k, block.v, block.positions
        if rope is None:
            k = block_k
        else:  # K's stored bytes checked before they are rotated
            if k_check is not None:
                k_check.check(crc32c(bytes_of(block_k)))
                k_check = None
            k = rope.rotate(block_k, positions, inverse=True)
        # Pages are released as soon as they are added, or with their window (`windows`: small
        # segments, whose pages hold other heads' records).
        after = functools.partial(snap.release, group) if release_each else None
        if pipeline is not None:
            pipeline.add(k_acc, k, positions, check=k_check)
            pipeline.add(v_acc, block_v, positions, after=after, check=v_check)
            continue
        k_acc.add(k, positions, k_check)
        v_acc.add(block_v, positions, v_check)
        if after is not None:
            after()


def _joined(segments: list[kvformat.Segment]) -> Iterator[list[kvformat.Segment]]:
    """One head's segments in groups added at once: every large segment alone, consecutive
    small ones together (up to `accumulator.PIECE` rows)."""
    from .accumulator import PIECE

    group: list[kvformat.Segment] = []
    rows = 0
    for segment in segments:
        if group and (rows + segment.count > PIECE or segment.count >= PIECE):
            yield group
            group, rows = [], 0
        group.append(segment)
        rows += segment.count
    if group:
        yield group


def layer_ropes(snap: kvformat.Snapshot, keys: str) -> dict[int, Rope | None]:
    """The RoPE of every present layer, from the file's metadata: None where it does not say
    (an error with ``keys="pre_rope"``, which needs it to un-rotate K)."""
    ropes: dict[int, Rope | None] = {}
    for layer, spec in enumerate(snap.layers):
        if not spec.present:
            continue
        try:
            ropes[layer] = Rope.from_metadata(snap.metadata, spec.attributes, spec.k_dim)
        except ValueError:
            if keys == "pre_rope":
                raise
            ropes[layer] = None
    return ropes


def layer_heads(snap: kvformat.Snapshot, layer: int) -> list[tuple[int, int]]:
    """The ``(seq, head)`` pairs of ``layer``, in the order of its accumulators and table rows."""
    return [(seq, head) for seq in range(snap.num_seqs) for head in range(snap.layers[layer].num_heads)]


def fresh_accumulators(
    snap: kvformat.Snapshot,
    layer: int,
    rope: Rope | None,
    options: PassOptions,
    heads: list[tuple[int, int]] | None = None,
) -> dict[Key, HeadAccumulator]:
    """Empty accumulators for every (seq, head, tensor) of ``layer`` (of ``heads`` only, when
    given: ``(seq, head)`` pairs); K's knows its ``rope``. On mlx those of one dim share one
    layout of their array sums (`accumulator.stack`: the device's results for a batch of the
    layer's pieces add in one call per sum)."""
    spec = snap.layers[layer]
    table: dict[Key, HeadAccumulator] = {}
    for seq, head in layer_heads(snap, layer) if heads is None else heads:
        table[(layer, seq, head, "k")] = HeadAccumulator(
            spec.k_dim, rope, options.stats, backend=options.backend
        )
        table[(layer, seq, head, "v")] = HeadAccumulator(
            spec.v_dim, None, options.stats, backend=options.backend
        )
    if options.backend == "mlx":
        for dim in {spec.k_dim, spec.v_dim}:
            stack([acc for acc in table.values() if acc.dim == dim])
    return table


def pass_order(snap: kvformat.Snapshot) -> tuple[list[Window], dict[int, int]]:
    """The pass's `windows` and, per layer, the index of its last segment in that order (the
    layer is done once the pass is past it)."""
    order = windows(snap)
    last = {seg.layer: i for i, seg in enumerate(s for w in order for s in w.segments)}
    return order, last


def _row_bytes(snap: kvformat.Snapshot) -> dict[int, int]:
    """Bytes of one token of K and V, per present layer."""
    return {
        layer: spec.row_bytes(0) + spec.row_bytes(1) for layer, spec in enumerate(snap.layers) if spec.present
    }


@dataclass
class Window:
    """Segments the pass reads together, in its order; ``release``: whether the window's pages
    are released as one once all its work is done (small segments)."""

    segments: list[kvformat.Segment]
    release: bool


def windows(snap: kvformat.Snapshot) -> list[Window]:
    """The snapshot's segments in the order the pass reads them: file order, except where
    segments are small on average (a series of snapshots, or a capture appended every few
    tokens, interleaves every head in the file): then the segments of each window of
    `WINDOW_BYTES` (K + V, in file order) are taken head by head, each head's in file order, so
    a head's small segments are read and added together."""
    segments = snap.segments()
    row_bytes = _row_bytes(snap)
    sizes = [segment.count * row_bytes[segment.layer] for segment in segments]
    if not segments or sum(sizes) >= SMALL_SEGMENT_BYTES * len(segments):
        return [Window(segments, False)]
    out: list[Window] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total >= WINDOW_BYTES or i == len(sizes) - 1:
            part = segments[start : i + 1]
            out.append(Window(sorted(part, key=lambda s: (s.layer, s.seq, s.head)), True))
            start, total = i + 1, 0
    return out


def head_batches(
    snap: kvformat.Snapshot, order: list[Window], last: dict[int, int]
) -> Iterator[tuple[list[kvformat.Segment], bool, Window | None]]:
    """The segments of ``order`` grouped into batches of consecutive segments of one head, each
    up to `BATCH_BYTES` of K and V (or one segment if larger); with each batch, whether it holds
    its layer's last segment (``last``: layer -> index of that segment in the pass order), and
    its window when it is the window's last batch."""
    row_bytes = _row_bytes(snap)
    index = 0  # of the segment in the pass order
    for window in order:
        batch: list[kvformat.Segment] = []
        size = 0
        for position, segment in enumerate(window.segments):
            if batch and (
                (segment.seq, segment.layer, segment.head) != (batch[0].seq, batch[0].layer, batch[0].head)
                or size >= BATCH_BYTES
            ):
                yield batch, False, None
                batch, size = [], 0
            batch.append(segment)
            size += segment.count * row_bytes[segment.layer]
            if last[segment.layer] == index:
                yield batch, True, window if position == len(window.segments) - 1 else None
                batch, size = [], 0
            index += 1
        if batch:
            yield batch, False, window


class _Workers:
    """The threads of one pass: an `OrderedPool` of ``options.workers`` threads for the batches (each
    head's batches in order), BLAS on one thread (the Gram's rounding then does not depend on the
    thread count), and for mlx the device `Pipeline` plus CPU threads for the rows."""

    def __init__(self, options: PassOptions) -> None:
        self.options = options
        self.pipeline: Any = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _Workers:
        from concurrent.futures import ThreadPoolExecutor

        from .parallel import OrderedPool, single_threaded_blas

        with self._stack as stack:
            mlx = self.options.backend == "mlx"
            if mlx:
                from .mlx_kernel import Pipeline, row_threads
            # The row threads stop after the pipeline (exits run in reverse): rows waiting for a
            # mark the pipeline drops after a failure then end with its error.
            self.row_threads = row_threads() if mlx else 1
            self.row_pool = stack.enter_context(
                ThreadPoolExecutor(self.row_threads, thread_name_prefix="kvsnap-rows")
            )
            if mlx:
                self.pipeline = stack.enter_context(Pipeline())
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
        snap.prefetch(batch)
        key = (first.layer, first.seq, first.head)
        return self.pool.submit(
            key, _add_segments, snap, batch, k_acc, v_acc, rope, self.pipeline, release_each
        )

    def finish_layer(self, layer: _OpenLayer, rows: bool) -> None:
        """After a layer's last batch: add the work that completes it to ``layer.work``. On mlx,
        the device pipeline's mark of the layer's end (``layer.mark``; nothing waits: the next
        layer is read and copied while this one is on the device) and, with ``rows``, the
        layer's rows computed once the mark is done, together in one run per row thread
        (`rows.compute`). On the CPU, with ``rows``, each row computed on the threads after its
        head's batches."""
        accumulators = layer.accumulators
        if self.pipeline is not None:
            mark = layer.mark = self.pipeline.mark()
            layer.work.append(mark)
            if rows:
                layer.work += [
                    self.row_pool.submit(after, mark, compute_rows, part)
                    for part in row_parts(list(accumulators.values()), self.row_threads)
                ]
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


def row_parts(accumulators: list[HeadAccumulator], threads: int) -> list[list[HeadAccumulator]]:
    """``accumulators`` cut into ``threads`` runs (fewer if there are fewer), whose rows are
    computed together (`rows.compute`), one run per thread."""
    size = max(1, -(-len(accumulators) // max(1, threads)))
    return [accumulators[start : start + size] for start in range(0, len(accumulators), size)]


@dataclass
class _OpenLayer:
    """A layer the pass has started: its accumulators and the work submitted for it."""

    accumulators: dict[Key, HeadAccumulator]
    work: list[Future[Any]] = field(default_factory=list)
    mark: Future[None] | None = None  # mlx: done once the device pipeline has folded the layer


LayerResult = tuple[str, int, int, dict[Key, HeadAccumulator]]
"""``(file name, snapshot index, layer, its accumulators)``."""


def layers(
    path: str | os.PathLike[str], options: PassOptions, progress: bool = False, finish: bool = False
) -> Iterator[LayerResult]:
    """One streaming pass over a file, yielding each layer's accumulators as soon as the pass is
    past the layer's last chunk and its work is done, so memory holds the accumulators of the
    layers in progress only (one or two for a layer-major file).

    With ``options.workers`` = T > 1, a local file goes to T worker processes on the CPU
    backend, `mlx_kernel.processes` (T) on mlx (`analysis.processes`, which reads it in the same
    batches). Otherwise (a URL, a small file; on mlx one thread drives the device)
    consecutive blocks of a head (up to 8 MiB of K and V, or one block if larger) go to T
    threads as one task, at most T + 2 such batches in flight
    (`analysis.parallel.OrderedPool`): memory is about ``(T + 3) x max(8 MiB, block) + T x 3 x
    2048 x head_dim x 4 bytes (float32 work buffers) + the accumulators of the layers in progress``
    (each ``~(head_dim^2 + 6 head_dim) x 8 + 36 KiB``). Where segments are small (a series
    of snapshots), the pass takes them head by head within windows of `WINDOW_BYTES` of the file
    (`windows`) and a head's small segments are read and added together (up to 8192 rows, one
    copy); a window's mapped pages are released once its work is done, so the resident file
    pages stay within about two windows. ``progress`` shows a bar per layer on
    stderr when it is a terminal; ``finish`` computes each accumulator's row (eigenvalues and
    all) on the threads, once its layer is read."""
    from . import processes

    if processes.usable(path, options.workers, options.backend):
        yield from processes.layers(path, options, progress, finish)
        return
    if options.backend == "mlx":  # in this process, one thread drives the device
        options = dataclasses.replace(options, workers=1)
    with kvformat.open(path, options.snapshot, storage_options=options.storage_options) as snap:
        name, index = os.fspath(path), snap.index
        ropes = layer_ropes(snap, options.keys)
        unrotate = options.keys == "pre_rope"
        order, last = pass_order(snap)
        regrouped = any(w.release for w in order)  # small segments: released by window
        bar = layer_bar(name, len(ropes), progress)
        for layer in ropes:
            if layer not in last:  # present but holding no tokens
                bar.update()
                yield name, index, layer, fresh_accumulators(snap, layer, ropes[layer], options)
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

        def release_done(wait: bool) -> None:
            while releasing and (wait or all(f.done() for f in releasing[0][1])):
                window, work = releasing.popleft()
                for future in work:
                    future.result()
                snap.release(window.segments)

        with _Workers(options) as workers, bar:
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
                release_done(wait=False)
                if closes:
                    workers.finish_layer(open_layer, finish)
                    closing.append(layer)
                while len(in_flight) > options.workers + 2:
                    in_flight.popleft().result()
                yield from finished(workers, keep=CLOSING_LAYERS)
            workers.drain()
            release_done(wait=True)
            yield from finished(workers, keep=0)


def layer_bar(name: str, layers: int, show: bool) -> Any:
    """A tqdm bar over the layers of one file: on stderr, only when it is a terminal."""
    from tqdm import tqdm

    return tqdm(
        total=layers,
        desc=os.path.basename(name) or name,
        unit="layer",
        file=sys.stderr,
        disable=None if show else True,  # None: off when stderr is not a terminal
        leave=False,
    )


def accumulate(path: str | os.PathLike[str], options: PassOptions) -> dict[Key, HeadAccumulator]:
    """One streaming pass over a file: the accumulator of every key."""
    table: dict[Key, HeadAccumulator] = {}
    for _, _, _, accumulators in layers(path, options):
        table.update(accumulators)
    return table
