"""One file's pass over worker processes: the path of a local file with more than one worker,
on the CPU backend (a worker per core) and on mlx (`kernels.mlx_sizing.processes` workers, each driving
the device with its own pipeline).

Threads in one process stall each other: between kernel calls each needs the GIL, and page
faults and page releases of one shared memory map serialize in the kernel. On 16 cores a
16-thread pass over the 8.6 GB seed file spent 54% of its thread time waiting (GIL, map lock,
TLB shootdowns), and the full catalogue ran at half the speed of the same arithmetic in memory.
Processes share the page cache and nothing else: each maps the file itself, reads and releases
its own pages and never waits for another's Python.

The pass's (seq, head) keys are cut into tasks, each a run of one layer's heads (about
the kernel's `Profile.tasks_per_worker` tasks per worker, so that uneven tasks even out). The parent
groups the
snapshot's segments as the one-worker pass does (`plan.windows`, `plan.head_batches`:
the same segments joined the same way, in the same order) and hands each task its heads'
batches; the task reads them from its own map of the file, adds them to fresh accumulators,
computes their rows when asked and sends the accumulators back (sealed once their rows are
computed: `HeadAccumulator.seal`, the rows without the sums, ~6 KB a head instead of ~180 KB).
Each accumulator is filled by one task, in file order, exactly as the one-worker pass fills it:
the results are identical (tests hold them equal). The parent yields a layer once all its
tasks are back, layers in the pass's order.

CPU workers are forked from a fork server (``multiprocessing``'s ``forkserver``: a clean process
that has imported the kernels and loaded their compiled code, `warm_kernels`); mlx workers are
spawned (`Profile.start_method`), so that they carry no CPU kernels. Either pool is started once per process
and kept for later passes. Workers run kvsnap's
code only, so they are started without the caller's ``__main__`` (``multiprocessing`` would
import the script into every worker, and run its top level again where it has no
``if __name__ == "__main__":`` guard).

Memory, per worker: the snapshot's index (as any reader holds it), the mapped pages of one
batch (``max(8 MiB, block)``, released once added; small segments: of one window), float32
work buffers of 6144 x head_dim, and one task's segments and accumulators; in the parent: the
pass's segment list (as the one-worker pass holds it) and the accumulators of at most ``2 x
workers`` tasks in flight plus the layers waiting for them. On mlx a worker also holds its
device pipeline (`kernels.mlx_pipeline.Pipeline`: two batches' staging buffers of 16 MiB, results waiting
to be folded) and mlx's own footprint, most of its memory on CUDA: mlx, its CUDA context and the
code of every kernel it has loaded (measured per worker in the benchmarks in `benchmarks/`).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import kvformat
from kvformat import pages
from kvformat.io import remote

from ..dependencies import futures_process, multiprocessing
from ..kernels import profile
from . import executors, fork_server
from .fork_server import FULL_CORES, PROCESS_MIN_BYTES, PROCESS_MIN_HEADS, START_METHOD
from .parallel import limit_blas_threads
from .plan import (
    add_segments,
    fresh_accumulators,
    head_batches,
    layer_bar,
    layer_heads,
    layer_ropes,
    layers_of_part,
    pass_order,
    row_parts,
)
from .rows import compute as compute_rows

if TYPE_CHECKING:  # the kernels load in the workers; this module stays light to import
    # (multiprocessing and the process pool, too: a command on a small file never starts one)
    from ..kernels import Profile
    from ..kernels.mlx_pipeline import Pipeline
    from ..stats.rope import Rope
    from .accumulator import HeadAccumulator
    from .plan import Key, LayerResult, PassOptions, Window

MLX_ONE_SHOT_BYTES = 12 << 30
"""A command's one mlx pass (`kvsnap stats FILE --backend mlx`, one local file, no ``--jobs``)
over a smaller file runs in one process (`one_shot_in_process`): worker processes each start mlx
and a CUDA context, and those starts queue on the device, so below this size a fresh command is
faster in one process (the break-even measured in the benchmarks in `benchmarks/`). A long-lived process
(the API, a batch of files) keeps its workers and gains from them from its second pass on."""


def one_shot_in_process(path: str | os.PathLike[str]) -> bool:
    """Whether a command's single mlx pass over ``path`` stays in one process: a local file
    (not a pattern, not a URL) smaller than `MLX_ONE_SHOT_BYTES`."""

    return not remote.is_url(path) and 0 < _size(path) < MLX_ONE_SHOT_BYTES


def worker_count(workers: int, backend: str) -> int:
    """The worker processes a pass asked to use ``workers`` workers starts: as many on the CPU
    backend; on mlx `kernels.mlx_sizing.processes` (3/4 of them, bounded by memory: each drives the
    device)."""
    return profile(backend).processes(workers)


def usable(path: str | os.PathLike[str], workers: int, backend: str, worth: bool | None = None) -> bool:
    """Whether a pass over ``path`` with ``workers`` workers on ``backend`` runs on worker
    processes: more than one worker process (`worker_count`), a local file (URLs stay on
    threads: their reads share one connection pool) of at least `PROCESS_MIN_BYTES` or
    `PROCESS_MIN_HEADS` heads (scaled to the worker count; ``worth``, where given, decides
    instead: a pass whose work per head is not the statistics'), or with the workers already
    running, and a process allowed to start children (not a daemonic ``multiprocessing``
    worker)."""

    count = worker_count(workers, backend)
    worth = _running(count, backend) or (_worth_workers(path, count) if worth is None else worth)
    if not (profile(backend).worker_processes and count > 1 and not remote.is_url(path) and worth):
        return False

    allowed = START_METHOD in multiprocessing.get_all_start_methods()
    return allowed and not multiprocessing.current_process().daemon


def _worth_workers(path: str | os.PathLike[str], count: int) -> bool:
    """Whether the file is worth starting ``count`` worker processes for: `PROCESS_MIN_BYTES`
    or `PROCESS_MIN_HEADS`, both scaled by ``FULL_CORES / count`` (`fork_server.FULL_CORES`;
    its index read only where its size is not enough)."""
    scale = max(1, FULL_CORES // max(count, 1))
    return _size(path) >= PROCESS_MIN_BYTES * scale or _heads(path) >= PROCESS_MIN_HEADS * scale


def _size(path: str | os.PathLike[str]) -> int:
    """The file's size in bytes; 0 where it cannot be read (the pass then reports why)."""
    try:
        return os.path.getsize(path)
    except (OSError, ValueError):
        return 0


def _heads(path: str | os.PathLike[str]) -> int:
    """The (layer, KV head) pairs of the file's last snapshot, read from its index; 0 where it
    cannot be read (the pass then reports why)."""

    try:
        with kvformat.open(path) as snap:
            return sum(spec.num_heads for spec in snap.layers if spec.present)
    except (kvformat.KVFormatError, OSError, ValueError):
        return 0


def _running(workers: int, backend: str = "cpu") -> bool:
    """Whether a pool of ``workers`` workers for ``backend`` is already running."""
    return executors.is_kept((workers, backend))


def _pool(workers: int, backend: str = "cpu") -> executors.Processes:
    """The process executor of ``workers`` workers for ``backend``, started once and kept
    (`executors.kept`; another is shut down first). Every worker runs one BLAS thread.

    CPU workers are forked from the fork server, which has loaded the kernels (`warm_kernels`).
    mlx workers are spawned (`Profile.start_method`): nothing on mlx loads the CPU kernels."""

    def started() -> executors.Processes:
        method = profile(backend).start_method
        if method != START_METHOD:  # spawned: nothing of the CPU kernels' fork server
            return executors.Processes(workers, method, initializer=_one_blas_thread)
        fork_server.ensure_running()  # running already where `kvsnap` started it early
        return executors.Processes(workers, START_METHOD)

    return executors.kept((workers, backend), started)


def pool(workers: int) -> executors.Processes:
    """The kept CPU pool of ``workers`` worker processes (forked from the fork server, one BLAS
    thread each; started by `start`), for passes of their own (`simulate` spreads its layers
    over it). A caller that finds it broken (``BrokenProcessPool``) passes it to
    `executors.discard`."""
    return _pool(workers, "cpu")


def _one_blas_thread() -> None:
    """A spawned mlx worker's start: BLAS limited to one thread, as the fork server's environment
    limits the CPU workers' (a spawned process takes its parent's environment as it is, and
    changing that for each submit would race with the parent's other threads)."""

    limit_blas_threads(1)


def start(workers: int, backend: str = "cpu") -> None:
    """Start ``workers`` workers for ``backend`` (and the fork server for the CPU backend's) now,
    without waiting for them (the CLI calls it first, so that they start while it imports the
    rest; a pass, while it plans). A kept pool found broken (a worker died since the last pass)
    is replaced.

    The first worker of a new CPU pool comes once the fork server has loaded the kernels (0.6-1
    s), and ``ProcessPoolExecutor.submit`` waits for it: a new pool's workers are asked for on a
    helper thread, so the caller goes on meanwhile (its own submits wait for the server then)."""
    global _HELPER
    if _HELPER is not None and _HELPER.is_alive() and _running(workers, backend):
        return  # the workers asked for are on their way
    if _running(workers, backend):
        pool = _pool(workers, backend)
        try:
            pool.start()
        except futures_process.BrokenProcessPool:
            executors.discard(pool)
            start(workers, backend)
        return
    pool = _pool(workers, backend)
    _HELPER = threading.Thread(target=_ask_quietly, args=(pool,), name="kvsnap-workers", daemon=True)
    _HELPER.start()


_HELPER: threading.Thread | None = None


def settle(timeout: float = executors.STARTING_TIMEOUT) -> None:
    """Wait (``timeout`` seconds at most) until the workers asked for (`start`) have started. A
    command that fails right after asking for its workers calls it before it ends: a worker still
    starting when this process exits reads the pool's semaphores after they are gone and prints
    a traceback (and one whose start the exit cuts short can leave this process waiting)."""
    helper = _HELPER
    if helper is not None:
        helper.join(timeout)
    executors.settle_kept(timeout)


def _ask_quietly(pool: executors.Processes) -> None:
    """``pool.start()`` on the helper thread: a pool that breaks meanwhile is discarded, and the
    pass that uses it reports the failure."""
    try:
        pool.start()
    except (futures_process.BrokenProcessPool, RuntimeError):  # RuntimeError: shut down meanwhile
        executors.discard(pool)


@dataclass
class _Task:
    """One layer's heads ``(seq, head)`` (in the order of the layer's accumulators) and their
    batches: ``(window index, segments)`` in the pass's order; ``releases``: the byte span of
    each window the task touches whose pages go once its work there is done (small segments:
    `plan.windows`); ``release_each``: release each batch's chunks once added instead."""

    layer: int
    heads: list[tuple[int, int]]
    work: list[tuple[int, list[kvformat.Segment]]] = field(default_factory=list)
    releases: dict[int, tuple[int, int]] = field(default_factory=dict)
    release_each: bool = True


def _layer_tasks(layer: int, heads: list[tuple[int, int]], count: int, release_each: bool) -> list[_Task]:
    """One layer's ``(seq, head)`` keys cut into about ``count`` equal runs, a task each."""
    size = max(1, -(-len(heads) // count))
    return [
        _Task(layer, heads[start : start + size], release_each=release_each)
        for start in range(0, len(heads), size)
    ]


def _tasks(
    snap: kvformat.Snapshot,
    order: list[Window],
    last: dict[int, int],
    workers: int,
    per_worker: int,
) -> list[_Task]:
    """The pass's tasks, layer by layer in the order the layers close: each layer's (seq, head)
    keys cut into equal runs, about ``per_worker`` x ``workers`` tasks in all, each given its
    heads' batches exactly as `plan.head_batches` groups them for one worker."""

    layers = sorted(last, key=last.__getitem__)
    per_layer = max(1, -(-per_worker * workers // max(1, len(layers))))
    regrouped = any(window.release for window in order)
    tasks = [
        task
        for layer in layers
        for task in _layer_tasks(layer, layer_heads(snap, layer), per_layer, not regrouped)
    ]
    _deal(snap, tasks, order, head_batches(snap, order, last))
    return tasks


def _deal(
    snap: kvformat.Snapshot,
    tasks: list[_Task],
    order: list[Window],
    batches: Iterable[tuple[list[kvformat.Segment], Any, Any]],
) -> None:
    """Give each batch to the task that owns its head, with its window's index, and the byte
    span of each released window the task touches."""
    owner = {(task.layer, seq, head): task for task in tasks for seq, head in task.heads}
    spans = [pages.of(snap).byte_span(w.segments) if w.release and w.segments else None for w in order]
    window = 0
    for batch, _, window_end in batches:
        first = batch[0]
        task = owner[(first.layer, first.seq, first.head)]
        task.work.append((window, batch))
        span = spans[window]
        if span is not None:
            task.releases[window] = span
        if window_end is not None:
            window += 1


def layers(
    path: str | os.PathLike[str], options: PassOptions, progress: bool = False, finish: bool = False
) -> Iterator[LayerResult]:
    """`streaming.layers` on ``options.workers`` processes (see the module's docstring): the same
    layers in the same order with the same accumulators."""
    workers = worker_count(options.workers, options.backend)
    start(workers, options.backend)  # the workers start while the pass is planned
    pool = _pool(workers, options.backend)
    with kvformat.open(path, options.snapshot) as snap:
        name, index = os.fspath(path), snap.index
        # a pre_rope error raised here, before any work
        ropes = layers_of_part(layer_ropes(snap, options.keys), options.part)
        order, last = pass_order(snap, ropes)
        empty = {
            layer: fresh_accumulators(snap, layer, ropes[layer], options)
            for layer in ropes
            if layer not in last
        }
        closing = sorted(last, key=last.__getitem__)
        tasks = _tasks(snap, order, last, workers, profile(options.backend).tasks_per_worker)
    bar = layer_bar(name, len(ropes), progress)
    with bar:
        for layer, table in empty.items():  # present but holding no tokens
            bar.update()
            yield name, index, layer, table
        pending: collections.deque[tuple[_Task, Future[dict[Key, HeadAccumulator]]]] = collections.deque()
        next_task = 0
        try:
            for layer in closing:
                # Every task of this layer submitted, and up to 2 x workers in flight.
                while next_task < len(tasks) and (
                    len(pending) < 2 * workers or tasks[next_task].layer == layer
                ):
                    task = tasks[next_task]
                    future = pool.submit(_run_task, name, index, options, workers, task, finish)
                    pending.append((task, future))
                    next_task += 1
                # A layer's tasks split its heads in order, so their results join in that order.
                accumulators: dict[Key, HeadAccumulator] = {}
                while pending and pending[0][0].layer == layer:
                    accumulators.update(pending.popleft()[1].result())
                bar.update()
                yield name, index, layer, accumulators
        except futures_process.BrokenProcessPool:
            executors.discard(pool)
            raise
        finally:
            for _, future in pending:
                future.cancel()


# --- in the worker processes -------------------------------------------------------------------


_SNAPSHOT: tuple[tuple[Any, ...], kvformat.Snapshot] | None = None


def worker_snapshot(path: str, index: int) -> kvformat.Snapshot:
    """This worker's open snapshot ``index`` of ``path``, kept for the tasks that follow (the
    statistics' and `simulate`'s alike): reopened when the file was replaced or another one is
    asked for."""
    global _SNAPSHOT
    status = os.stat(path)
    identity = (path, index, status.st_dev, status.st_ino, status.st_mtime_ns)
    if _SNAPSHOT is None or _SNAPSHOT[0] != identity:
        if _SNAPSHOT is not None:
            _SNAPSHOT[1].close()
            _SNAPSHOT = None
        _SNAPSHOT = identity, kvformat.open(path, index)
    return _SNAPSHOT[1]


@dataclass
class _OpenFile:
    """A worker's `worker_snapshot` with the RoPE of each layer the pass's keys need."""

    keys: str
    snap: kvformat.Snapshot
    ropes: dict[int, Rope | None]


_OPEN: _OpenFile | None = None


def _open_file(path: str, index: int, options: PassOptions) -> _OpenFile:
    """This worker's `_OpenFile` of snapshot ``index`` of ``path``."""

    global _OPEN
    snap = worker_snapshot(path, index)
    if _OPEN is None or _OPEN.snap is not snap or _OPEN.keys != options.keys:
        _OPEN = _OpenFile(options.keys, snap, layer_ropes(snap, options.keys))
    return _OPEN


_BLAS_LIMITED = False
"""Whether this worker has limited BLAS to one thread (its first task does; the fork server's
environment and the mlx workers' initializer already ask for one thread, this makes sure)."""

_DEVICE: tuple[Pipeline, ThreadPoolExecutor] | None = None
_ROW_THREADS = 1  # the row threads of `_DEVICE`: a task's rows are computed in as many runs


def _device(kernel: Profile, workers: int) -> tuple[Pipeline, ThreadPoolExecutor]:
    """This worker's mlx pipeline and row threads (its share of the machine's, `workers`
    processes driving the device), made on its first mlx task and kept: staging buffers and
    compiled device functions serve the tasks that follow."""
    global _DEVICE, _ROW_THREADS
    if _DEVICE is None:
        pipeline = kernel.pipeline(workers, worker=True)
        assert pipeline is not None  # a device kernel's
        _ROW_THREADS = kernel.row_threads(workers)
        _DEVICE = pipeline, ThreadPoolExecutor(_ROW_THREADS, thread_name_prefix="kvsnap-rows")
    return _DEVICE


def _run_task(
    path: str, index: int, options: PassOptions, workers: int, task: _Task, finish: bool
) -> dict[Key, HeadAccumulator]:
    """In a worker (one of ``workers``): the accumulators of ``task``'s heads over the whole
    snapshot (their rows computed and sealed with ``finish``), its batches added in order,
    pages released as the one-worker pass releases them. On mlx the batches go through this
    worker's device pipeline, drained at the task's end."""

    opened = _open_file(path, index, options)
    snap, layer = opened.snap, task.layer
    rope = opened.ropes[layer]
    unrotate = rope if options.keys == "pre_rope" else None
    accumulators = fresh_accumulators(snap, layer, rope, options, task.heads)
    kernel = profile(options.backend)
    pipeline, rows = _device(kernel, workers) if kernel.device else (None, None)
    try:
        return _add_task(snap, task, accumulators, unrotate, pipeline, rows, finish)
    except BaseException:
        if pipeline is not None:  # what the failed task left queued is dropped with its pipeline
            _drop_device()
        raise


def _drop_device() -> None:
    global _DEVICE
    if _DEVICE is not None:
        pipeline, rows = _DEVICE
        _DEVICE = None
        pipeline.abandon()
        rows.shutdown(wait=False)


def _add_task(
    snap: kvformat.Snapshot,
    task: _Task,
    accumulators: dict[Key, HeadAccumulator],
    unrotate: Rope | None,
    pipeline: Pipeline | None,
    rows: ThreadPoolExecutor | None,
    finish: bool,
) -> dict[Key, HeadAccumulator]:
    """`_run_task`'s work: ``task``'s batches added to ``accumulators`` in order (through the
    device ``pipeline`` on mlx), pages released, rows computed and sealed with ``finish``."""

    global _BLAS_LIMITED
    if not _BLAS_LIMITED:  # once per worker: a call inspects every loaded library
        limit_blas_threads(1)
        _BLAS_LIMITED = True
    layer = task.layer
    for i, (window, batch) in enumerate(task.work):
        first = batch[0]
        add_segments(
            snap,
            batch,
            accumulators[(layer, first.seq, first.head, "k")],
            accumulators[(layer, first.seq, first.head, "v")],
            unrotate,
            pipeline,
            release_each=task.release_each,
        )
        leaving = i == len(task.work) - 1 or task.work[i + 1][0] != window
        if leaving and window in task.releases:
            pages.of(snap).release_span(*task.releases[window])
    if pipeline is not None:
        pipeline.finish()
    if finish:
        _finish_rows(list(accumulators.values()), rows if pipeline is not None else None)
    return accumulators


def _finish_rows(accumulators: list[HeadAccumulator], rows: ThreadPoolExecutor | None) -> None:
    """Compute every accumulator's row (on the ``rows`` threads when given) and seal them."""

    if rows is None:
        compute_rows(accumulators)
    else:
        for future in [rows.submit(compute_rows, part) for part in row_parts(accumulators, _ROW_THREADS)]:
            future.result()
    for accumulator in accumulators:
        accumulator.seal()
