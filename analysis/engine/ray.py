"""Ray Data over `.kv` files: one read task per file, each running `stats_for_file` and yielding
one Arrow table per layer, so Ray's streaming executor bounds memory and schedules the files.

    import ray, analysis.engine.ray
    ray.init()                                   # or ray.init(address="ray://head:10001")
    ds = analysis.engine.ray.read_kv(["s3://bucket/runs/a.kv", ...])
    ds.to_pandas()                               # one row per (file, seq, layer, head, tensor)

Needs ``pip install 'kvsnap[ray]'``. We build no scheduler: Ray places and retries the tasks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import Any

import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from ..dependencies import pa
from ..stats import stat_groups
from ..stats.accumulator import HeadAccumulator
from .files import (
    BatchResult,
    FileFailure,
    MergedKey,
    Options,
    describe_error,
    expand_paths,
    file_or_failure,
    sort_like,
)
from .plan import BatchOptions
from .tables import PassOptions, frame_of, layer_tables, merged_accumulators

ERROR_COLUMNS = ("file", "error")


def _read_file(path: str, options: PassOptions, errors: str) -> Iterator[pa.Table]:

    try:
        yield from layer_tables(path, options)
    except Exception as exc:
        if errors == "raise":
            raise
        yield pa.table({"file": [path], "error": [describe_error(exc)]})


class KVDatasource(Datasource):
    """Per-head statistic rows of `.kv` files (paths or URLs): one read task per file.

    ``errors="collect"`` turns a failing file into one ``(file, error)`` row instead of failing
    the dataset; `ray_stats` separates those rows from the statistics."""

    def __init__(self, paths: list[str], options: PassOptions, errors: str = "raise") -> None:
        if errors not in ("raise", "collect"):
            raise ValueError("errors must be 'raise' or 'collect'")
        self.paths = list(paths)
        self.options = dataclasses.replace(options, workers=1, progress=False)  # Ray schedules the cores
        self.errors = errors

    def get_name(self) -> str:
        return "KV"

    def estimate_inmemory_data_size(self) -> int | None:
        return None  # the output is a few KB per head, whatever the file size

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        tasks = []
        for path in self.paths:
            tasks.append(
                ReadTask(
                    functools.partial(_read_file, path, self.options, self.errors),
                    BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=(path,)),
                )
            )
        return tasks


def read_kv(
    paths: str | list[str],
    *,
    snapshot: int = -1,
    keys: str = "post_rope",
    stats: str | list[str] | None = None,
    storage_options: Options | None = None,
    errors: str = "raise",
) -> ray.data.Dataset:
    """A `ray.data.Dataset` of per-head statistic rows of the files (paths, URLs or glob patterns),
    the same rows as `analysis.head_stats`, one read task per file (one thread each: Ray
    schedules the cores)."""
    files = expand_paths([paths] if isinstance(paths, str) else paths, storage_options)
    options = PassOptions(
        snapshot=snapshot, keys=keys, stats=stat_groups(stats), storage_options=storage_options
    )
    return _dataset(files, options, errors)


def _dataset(files: list[str], options: PassOptions, errors: str) -> ray.data.Dataset:
    return ray.data.read_datasource(KVDatasource(files, options, errors), override_num_blocks=len(files))


def _connect(address: str | None, num_cpus: int) -> None:
    """Join the cluster at ``address`` or start local Ray; Ray's and Ray Data's INFO lines (start,
    execution plan, progress) kept off the terminal: the command prints its own result."""
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if ray.is_initialized():
        return
    quiet = logging.WARNING
    if address:
        ray.init(address=address, log_to_driver=False, logging_level=quiet)
    else:
        ray.init(num_cpus=max(1, num_cpus), include_dashboard=False, log_to_driver=False, logging_level=quiet)


def ray_stats(paths: list[str], options: BatchOptions) -> BatchResult:
    """`analysis.engine.batch.run_stats` on Ray: the same table, the failures collected by file."""
    _connect(options.address, options.cores)
    context = ray.data.DataContext.get_current()
    preserve = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # each file's layers in the order of its pass
    try:
        with _unwrapped():
            return _collect(paths, options)
    finally:
        context.execution_options.preserve_order = preserve


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """Re-raise a task's own exception (a `KVFormatError` naming the file, say) rather than
    Ray's wrapper, whose message carries the remote traceback."""
    try:
        yield
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


def _collect(paths: list[str], options: BatchOptions) -> BatchResult:
    _, pass_options = options.plan(len(paths))
    dataset = _dataset(paths, pass_options, "raise" if options.fail_fast else "collect")
    tables: list[pa.Table] = []
    failures: list[FileFailure] = []
    for reference in dataset.to_arrow_refs():
        table = ray.get(reference)
        if tuple(table.column_names) == ERROR_COLUMNS:
            failures.extend(FileFailure(f, e) for f, e in zip(*table.to_pydict().values(), strict=True))
        elif table.num_rows:
            tables.append(table)
    order = {path: i for i, path in enumerate(paths)}
    failures.sort(key=lambda failure: order.get(failure.file, len(paths)))
    return BatchResult(sort_like(frame_of(tables), paths).to_arrow(), failures, len(paths))


@ray.remote
def _accumulators_task(
    path: str, options: PassOptions, fail_fast: bool
) -> dict[MergedKey, HeadAccumulator] | FileFailure:
    return file_or_failure(path, merged_accumulators, options, fail_fast)


def ray_accumulators(
    paths: list[str], options: BatchOptions
) -> Iterator[tuple[str, dict[MergedKey, HeadAccumulator] | FileFailure]]:
    """Each file's mergeable state, computed by Ray tasks, yielded in the order of ``paths`` (so
    merged sums are added in the same order as on the local engine, bit for bit) with at most
    ``2 x cluster CPUs`` tasks in flight, so the driver holds few states at once."""
    _connect(options.address, options.cores)
    window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    _, pass_options = options.plan(len(paths))
    one_thread = dataclasses.replace(pass_options, workers=1, progress=False)  # Ray schedules the cores
    fail_fast = options.fail_fast
    pending: collections.deque[tuple[str, Any]] = collections.deque()
    queue = collections.deque(paths)
    while queue or pending:
        while queue and len(pending) < window:
            path = queue.popleft()
            pending.append((path, _accumulators_task.remote(path, one_thread, fail_fast)))
        path, reference = pending.popleft()
        with _unwrapped():
            result = ray.get(reference)
        yield path, result
