"""Statistics over many snapshots: path and URL patterns, per-file failures, engines, merging.

Two engines run the same per-file core (`analysis.stats.stats_for_file` /
`analysis.stats.file_accumulators`): ``"local"`` (processes on this machine) and ``"ray"``
(`analysis.ray`, Ray Data on a local or remote cluster). A file that fails is reported with its
name and collected in `BatchResult.failures`; the other files go on unless ``fail_fast``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvsnap.analysis.files import (
    BatchResult,
    FileFailure,
    MergedKey,
    Options,
    describe_error,
    expand_paths,
    file_or_failure,
)
from kvsnap.analysis.parallel import cores, local_map, split_jobs
from kvsnap.analysis.stats import (
    HeadAccumulator,
    PassOptions,
    file_table,
    frame_of,
    merged_accumulators,
    stat_groups,
)

if TYPE_CHECKING:
    import polars as pl
    import pyarrow as pa

__all__ = ["BatchResult", "FileFailure", "Merger", "expand_paths", "merged_stats", "run_stats"]


def _plan(
    paths: list[str],
    jobs: int | None,
    snapshot: int,
    keys: str,
    stats: str | Iterable[str] | None,
    storage_options: Options | None,
    backend: str = "cpu",
) -> tuple[int, PassOptions]:
    """Processes for the files and each file's pass options (its threads: the cores left; with
    ``backend="mlx"``, one process and one thread driving the device)."""
    processes, threads = split_jobs(cores() if jobs is None else jobs, len(paths))
    if backend == "mlx":
        processes = threads = 1
    options = PassOptions(
        snapshot,
        keys,
        stat_groups(stats),
        threads,
        storage_options,
        progress=len(paths) == 1,
        backend=backend,
    )
    return processes, options


def run_stats(
    patterns: str | Iterable[str],
    *,
    engine: str = "local",
    jobs: int | None = None,
    address: str | None = None,
    fail_fast: bool = False,
    snapshot: int = -1,
    keys: str = "post_rope",
    stats: str | Iterable[str] | None = None,
    storage_options: Options | None = None,
    progress: Callable[[str], None] | None = None,
    backend: str = "cpu",
) -> BatchResult:
    """Per-head statistics of every file the patterns name, one row per (file, seq, layer, head,
    tensor), with ``engine`` ``"local"`` (``jobs`` cores, default all: files in processes, the
    cores left as threads within each file) or ``"ray"`` (``address`` of a cluster, or a local
    one with ``jobs`` CPUs); ``stats`` names the statistic groups (default all); ``backend``
    ``"cpu"`` or ``"mlx"`` (mlx's default device, a GPU where there is one). Same rows, same
    order, for both engines."""
    paths = expand_paths([patterns] if isinstance(patterns, str) else patterns, storage_options)
    processes, options = _plan(paths, jobs, snapshot, keys, stats, storage_options, backend)
    if engine == "ray":
        from kvsnap.analysis.ray import ray_stats

        return ray_stats(paths, options, address=address, num_cpus=jobs or cores(), fail_fast=fail_fast)
    if engine != "local":
        raise ValueError(f"engine must be 'local' or 'ray', not {engine!r}")
    tables: list[pa.Table] = []
    failures: list[FileFailure] = []
    for path, result in zip(
        paths, local_map(file_or_failure, paths, processes, file_table, options, fail_fast), strict=True
    ):
        if isinstance(result, FileFailure):
            failures.append(result)
        else:
            tables.append(result)
        if progress:
            progress(path)
    return BatchResult(frame_of(tables), failures, len(paths))


class Merger:
    """Accumulators of (layer, head, tensor) merged over files, checking the files agree."""

    def __init__(self) -> None:
        self.state: dict[MergedKey, HeadAccumulator] = {}
        self.files = 0

    def add(self, path: str, accumulators: dict[MergedKey, HeadAccumulator]) -> None:
        """Merge one file's state; ValueError naming the file if its heads or dims differ."""
        if self.state and accumulators.keys() != self.state.keys():
            raise ValueError(f"{path}: layers or heads differ from the files merged before it")
        for key, acc in accumulators.items():
            mine = self.state.get(key)
            if mine is not None and mine.dim != acc.dim:
                raise ValueError(
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
        import polars as pl

        rows = [
            {"n_files": self.files, "layer": layer, "head": head, "tensor": tensor, **acc.row()}
            for (layer, head, tensor), acc in sorted(self.state.items())
        ]
        return pl.from_dicts(rows, infer_schema_length=None) if rows else pl.DataFrame()


def merged_stats(
    patterns: str | Iterable[str],
    *,
    engine: str = "local",
    jobs: int | None = None,
    address: str | None = None,
    fail_fast: bool = False,
    snapshot: int = -1,
    keys: str = "post_rope",
    stats: str | Iterable[str] | None = None,
    storage_options: Options | None = None,
    progress: Callable[[str], None] | None = None,
    backend: str = "cpu",
) -> BatchResult:
    """Statistics of each (layer, head, tensor) over every token of every sequence of every file
    ("average over 200 prompts"): each file's mergeable state (moments, Gram matrix, histograms,
    top-k) is combined as it arrives, so memory holds one model's worth of accumulators. The
    files must share the layer/head layout; one that does not is a failure naming it.
    ``massive_positions`` then index each top value's own file; ``sink_ratio`` uses the mean
    ||x_0|| over the sequences. ``jobs`` and ``stats`` as in `run_stats`."""
    paths = expand_paths([patterns] if isinstance(patterns, str) else patterns, storage_options)
    processes, options = _plan(paths, jobs, snapshot, keys, stats, storage_options, backend)
    merger = Merger()
    failures: list[FileFailure] = []
    if engine == "ray":
        from kvsnap.analysis.ray import ray_accumulators

        results: Iterable[tuple[str, Any]] = ray_accumulators(
            paths, options, address=address, num_cpus=jobs or cores(), fail_fast=fail_fast
        )
    elif engine == "local":
        results = zip(
            paths,
            local_map(file_or_failure, paths, processes, merged_accumulators, options, fail_fast),
            strict=True,
        )
    else:
        raise ValueError(f"engine must be 'local' or 'ray', not {engine!r}")
    for path, result in results:
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
    return BatchResult(merger.table(), failures, len(paths))
