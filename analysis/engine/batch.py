"""Statistics over many snapshots: path and URL patterns, per-file failures, engines, merging.

A batch is planned once (`plan.BatchOptions.plan`: each file's parts and the executor that runs
them) and carried out the same way on both engines: ``"local"`` (processes on this machine) and
``"ray"`` (Ray tasks on a local or remote cluster) are executors (`engine.executors`) running the
same per-file core (`analysis.engine.tables.file_table` / `merged_accumulators`). A file that
fails is reported with its name and collected in `BatchResult.failures`; the other files go on
unless ``fail_fast``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from kvformat.errors import ConflictingArgumentsError

from ..dependencies import pa, pl
from ..errors import LayoutMismatchError
from .accumulator import HeadAccumulator
from .files import (
    BatchResult,
    FileFailure,
    MergedKey,
    describe_error,
    expand_paths,
    first_failure,
    parts_by_file,
)
from .plan import BatchOptions
from .tables import file_table, merged_accumulators, rows_of

if TYPE_CHECKING:
    from .plan import Plan


__all__ = [
    "BatchOptions",
    "BatchResult",
    "FileFailure",
    "Merger",
    "expand_paths",
    "head_stats",
    "merged_stats",
    "run_stats",
]


def head_stats(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    merge: bool = False,
    failures: list[FileFailure] | None = None,
    progress: Callable[[str], None] | None = None,
    **settings: Any,
) -> pl.DataFrame:
    """The per-head statistics of snapshots as a Polars DataFrame: kvsnap's one way to get the
    table (``kvsnap stats`` runs the same). One row per (file, snapshot, seq, layer, head,
    tensor); with ``merge=True``, one per (layer, head, tensor) over every token of every file
    (each file's sums merged as it arrives: ``n_files`` first; ``kvsnap stats --merge``).

    ``paths``: a path, URL or glob pattern (``runs/*.kv``, ``s3://bucket/runs/*.kv``), or several.
    ``settings``, all keywords: ``stats`` (groups, default all: `GROUPS`), ``keys``
    (``"post_rope"``, or ``"pre_rope"`` to un-rotate K first), ``snapshot`` (default the last),
    ``backend`` (``"cpu"``, or ``"mlx"``: mlx's default device), ``jobs`` (cores, default all),
    ``engine`` (``"local"`` processes or ``"ray"``, with ``address``), ``storage_options``
    (remote files). ``failures``: None raises the first failing file's error; a list collects
    each failing file (`FileFailure`: its path and the error) and the others' rows come back.
    ``progress`` is called with each file's name as it finishes. An Arrow table of the same rows:
    ``.to_arrow()``."""
    if "fail_fast" in settings:
        raise ConflictingArgumentsError("head_stats takes failures=[...] (collect) or nothing (raise)")
    patterns = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    run = merged_stats if merge else run_stats
    result = run(patterns, progress=progress, fail_fast=failures is None, **settings)
    if failures is not None:
        failures.extend(result.failures)
    return result.table


def run_stats(
    patterns: str | Iterable[str],
    options: BatchOptions | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    sink: Callable[[pa.Table], None] | None = None,
    **settings: Any,
) -> BatchResult:
    """Per-head statistics of every file the patterns name, one row per (file, seq, layer, head,
    tensor). ``options`` (`BatchOptions`), or its fields as keywords (``jobs=8``,
    ``engine="ray"``, ``stats="norms"``...), say how: the ``"local"`` engine (``jobs`` cores,
    default all: files in processes, the cores left as each file's workers) or ``"ray"``
    (``address`` of a cluster, or a local one with ``jobs`` CPUs). Same rows, same order, for
    both engines. ``progress`` is called with each file name as it finishes; ``sink`` with the
    rows' tables in order, each as soon as its file is done (on one core, each layer's as soon
    as it is computed), to write them while the other files are computed."""
    options = BatchOptions.of(options, settings)
    paths = expand_paths([patterns] if isinstance(patterns, str) else patterns, options.storage_options)
    plan = options.plan(paths)
    here = plan.in_process  # each layer's table goes to the sink as it is computed
    work = functools.partial(file_table, sink=sink) if here and sink is not None else file_table
    tables: list[pa.Table] = []
    failures: list[FileFailure] = []
    for path, found in parts_by_file(plan, work, options.fail_fast):
        failure = first_failure(found)
        if failure is not None:
            failures.append(failure)
        else:
            tables.extend(found)
            _send(found, sink if not here else None)
        if progress:
            progress(path)
    return BatchResult(rows_of(tables), failures, len(paths))


class Merger:
    """Accumulators of (layer, head, tensor) merged over files, checking the files agree."""

    def __init__(self) -> None:
        self.state: dict[MergedKey, HeadAccumulator] = {}
        self.files = 0

    def add(self, path: str, accumulators: dict[MergedKey, HeadAccumulator]) -> None:
        """Merge one file's state; ValueError naming the file if its heads or dims differ."""
        if self.state and accumulators.keys() != self.state.keys():
            raise LayoutMismatchError(f"{path}: layers or heads differ from the files merged before it")
        for key, acc in accumulators.items():
            mine = self.state.get(key)
            if mine is not None and mine.dim != acc.dim:
                raise LayoutMismatchError(
                    f"{path}: layer {key[0]} head {key[1]} {key[2]} has {acc.dim} channels, "
                    f"the files merged before it {mine.dim}"
                )
        for key, acc in accumulators.items():
            if key in self.state:
                self.state[key].merge(acc)
            else:
                self.state[key] = acc
        self.files += 1

    def table(self) -> pl.DataFrame:

        rows = [
            {"n_files": self.files, "layer": layer, "head": head, "tensor": tensor, **acc.row()}
            for (layer, head, tensor), acc in sorted(self.state.items())
        ]
        return pl.from_dicts(rows, infer_schema_length=None) if rows else pl.DataFrame()


def merged_stats(
    patterns: str | Iterable[str],
    options: BatchOptions | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    **settings: Any,
) -> BatchResult:
    """Statistics of each (layer, head, tensor) over every token of every sequence of every file
    ("average over 200 prompts"): each file's mergeable state (moments, Gram matrix, histograms,
    top-k) is combined as it arrives, so memory holds one model's worth of accumulators. The
    files must share the layer/head layout; one that does not is a failure naming it.
    ``massive_positions`` then index each top value's own file; ``sink_ratio`` uses the mean
    ||x_0|| over the sequences. ``options``, ``settings`` and ``progress`` as in `run_stats`."""
    options = BatchOptions.of(options, settings)
    fail_fast = options.fail_fast
    paths = expand_paths([patterns] if isinstance(patterns, str) else patterns, options.storage_options)
    merger = Merger()
    failures: list[FileFailure] = []
    for path, result in _merged_by_file(options.plan(paths), fail_fast):
        if isinstance(result, FileFailure):
            failures.append(result)
        else:
            try:
                merger.add(path, result)
            except ValueError as exc:
                if fail_fast:
                    raise
                failures.append(FileFailure(path, describe_error(exc)))
        if progress:
            progress(path)
    return BatchResult(merger.table().to_arrow(), failures, len(paths))


def _merged_by_file(plan: Plan, fail_fast: bool) -> Iterator[tuple[str, Any]]:
    """``(path, accumulators or FileFailure)`` per file, in order: the plan's tasks run as
    `run_stats` runs them (`parts_by_file`), each file's parts' accumulators joined (their
    layers do not overlap). Merged in the order of the paths on every executor, the sums are
    the same bit for bit."""
    for path, found in parts_by_file(plan, merged_accumulators, fail_fast):
        failure = first_failure(found)
        joined = {
            key: acc for part in found if not isinstance(part, FileFailure) for key, acc in part.items()
        }
        yield path, failure if failure is not None else joined


def _send(tables: list[pa.Table], sink: Callable[[pa.Table], None] | None) -> None:
    """Each of ``tables`` to ``sink``, where there is one."""
    if sink is None:
        return
    for table in tables:
        sink(table)
