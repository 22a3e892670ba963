"""Statistics over many snapshots: path and URL patterns, per-file failures, engines, merging.

Two engines run the same per-file core (`analysis.stats.stats_for_file` /
`analysis.stats.file_accumulators`): ``"local"`` (processes on this machine) and ``"ray"``
(`analysis.ray`, Ray Data on a local or remote cluster). A file that fails is reported with its
name and collected in `BatchResult.failures`; the other files go on unless ``fail_fast``.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from analysis.stats import HeadAccumulator, _file_table, file_accumulators, frame_of, local_map
from kvformat.remote import expand, is_url

if TYPE_CHECKING:
    import polars as pl
    import pyarrow as pa

Options = dict[str, Any]
MergedKey = tuple[int, int, str]  # (layer, head, "k" | "v")


@dataclass(frozen=True)
class FileFailure:
    """A file whose statistics could not be computed: its name and ``"ErrorClass: message"``."""

    file: str
    error: str


@dataclass
class BatchResult:
    """The statistics table of the files that worked and the failures of those that did not."""

    table: pl.DataFrame
    failures: list[FileFailure] = field(default_factory=list)
    files: int = 0


def expand_paths(patterns: Iterable[str], storage_options: Options | None = None) -> list[str]:
    """Paths and URLs with glob patterns expanded (``runs/*.kv``, ``s3://bucket/runs/*.kv``), in
    the order given, each pattern's matches sorted; a pattern that matches nothing is an error."""
    found: list[str] = []
    for pattern in patterns:
        if is_url(pattern):
            matches = expand(pattern, storage_options=storage_options)
        elif any(c in pattern for c in "*?["):
            matches = sorted(glob.glob(pattern, recursive=True))
        else:
            matches = [pattern]
        if not matches:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        found.extend(matches)
    return found


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def file_or_failure(
    path: str,
    work: Callable[..., Any],
    snapshot: int,
    keys: str,
    storage_options: Options | None,
    fail_fast: bool,
) -> Any:
    """``work(path, snapshot, keys, storage_options)``, or the `FileFailure` it raised (raised
    again with ``fail_fast``). ``path`` first, as `local_map` calls it."""
    try:
        return work(path, snapshot, keys, storage_options)
    except Exception as exc:
        if fail_fast:
            raise
        return FileFailure(path, describe_error(exc))


def sort_like(table: pl.DataFrame, paths: list[str]) -> pl.DataFrame:
    """Rows in the order of ``paths``, each file's rows in the order its pass produced them (a
    stable sort): the local engine's order."""
    import polars as pl

    if table.is_empty():
        return table
    order = {path: i for i, path in enumerate(paths)}
    rank = pl.col("file").replace_strict(order, default=len(paths), return_dtype=pl.Int64)
    return table.with_columns(rank.alias("__order")).sort("__order", maintain_order=True).drop("__order")


def run_stats(
    patterns: str | Iterable[str],
    *,
    engine: str = "local",
    jobs: int = 1,
    address: str | None = None,
    fail_fast: bool = False,
    snapshot: int = -1,
    keys: str = "post_rope",
    storage_options: Options | None = None,
    progress: Callable[[str], None] | None = None,
) -> BatchResult:
    """Per-head statistics of every file the patterns name, one row per (file, seq, layer, head,
    tensor), with ``engine`` ``"local"`` (``jobs`` processes) or ``"ray"`` (``address`` of a
    cluster, or a local one with ``jobs`` CPUs). Same rows, same order, for both engines."""
    paths = expand_paths([patterns] if isinstance(patterns, str) else patterns, storage_options)
    if engine == "ray":
        from analysis.ray import ray_stats

        return ray_stats(
            paths,
            address=address,
            num_cpus=jobs,
            fail_fast=fail_fast,
            snapshot=snapshot,
            keys=keys,
            storage_options=storage_options,
        )
    if engine != "local":
        raise ValueError(f"engine must be 'local' or 'ray', not {engine!r}")
    tables: list[pa.Table] = []
    failures: list[FileFailure] = []
    for path, result in zip(
        paths,
        local_map(file_or_failure, paths, jobs, _file_table, snapshot, keys, storage_options, fail_fast),
        strict=True,
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
    jobs: int = 1,
    address: str | None = None,
    fail_fast: bool = False,
    snapshot: int = -1,
    keys: str = "post_rope",
    storage_options: Options | None = None,
    progress: Callable[[str], None] | None = None,
) -> BatchResult:
    """Statistics of each (layer, head, tensor) over every token of every sequence of every file
    ("average over 200 prompts"): each file's mergeable state (moments, Gram matrix, histograms,
    top-k) is combined as it arrives, so memory holds one model's worth of accumulators. The
    files must share the layer/head layout; one that does not is a failure naming it.
    ``massive_positions`` then index each top value's own file; ``sink_ratio`` uses the mean
    ||x_0|| over the sequences."""
    paths = expand_paths([patterns] if isinstance(patterns, str) else patterns, storage_options)
    merger = Merger()
    failures: list[FileFailure] = []
    if engine == "ray":
        from analysis.ray import ray_accumulators

        results: Iterable[tuple[str, Any]] = ray_accumulators(
            paths,
            address=address,
            num_cpus=jobs,
            fail_fast=fail_fast,
            snapshot=snapshot,
            keys=keys,
            storage_options=storage_options,
        )
    elif engine == "local":
        results = zip(
            paths,
            local_map(
                file_or_failure, paths, jobs, file_accumulators, snapshot, keys, storage_options, fail_fast
            ),
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
