"""What the batch engines share beside their plan (`plan.BatchOptions`, `plan.file_tasks`): file
patterns, running a plan's tasks (`parts_by_file`), per-file failures, the result of a batch.

`analysis.engine.batch` (the entry points) uses this module and, when asked for Ray, `analysis.engine.ray`;
`analysis.engine.ray` uses this module and `analysis.stats`. Nothing here imports either engine, so the
dependencies run one way: batch -> ray -> files, stats.
"""

from __future__ import annotations

import functools
import glob
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvformat.io.remote import expand, is_url

from ..dependencies import pa, pl
from .parallel import local_map
from .plan import PassOptions

if TYPE_CHECKING:
    from .plan import PassOptions

Options = dict[str, Any]
MergedKey = tuple[int, int, str]  # (layer, head, "k" | "v")


@dataclass(frozen=True)
class FileFailure:
    """A file whose statistics could not be computed: its name and ``"ErrorClass: message"``."""

    file: str
    error: str


@dataclass
class BatchResult:
    """The statistics of the files that worked, as an Arrow table (``rows``; `table`: the same as
    a Polars DataFrame), and the failures of those that did not."""

    rows: pa.Table
    failures: list[FileFailure] = field(default_factory=list)
    files: int = 0

    @functools.cached_property
    def table(self) -> pl.DataFrame:
        """``rows`` as a Polars DataFrame (polars imported here, on first use: ``kvsnap stats``
        prints and saves ``rows`` without it)."""

        frame = pl.from_arrow(self.rows)
        assert isinstance(frame, pl.DataFrame)
        return frame


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
    path: str, work: Callable[[str, PassOptions], Any], options: PassOptions, fail_fast: bool
) -> Any:
    """``work(path, options)``, or the `FileFailure` it raised (raised again with
    ``fail_fast``). ``path`` first, as `parallel.local_map` calls it."""
    try:
        return work(path, options)
    except Exception as exc:
        if fail_fast:
            raise
        return FileFailure(path, describe_error(exc))


def part_or_failure(
    task: tuple[Any, PassOptions], work: Callable[[Any, PassOptions], Any], fail_fast: bool
) -> Any:
    """`file_or_failure` of one task of `plan.file_tasks`: ``(path, the part's options)``."""
    path, options = task
    return file_or_failure(path, work, options, fail_fast)


def parts_by_file(
    paths: Sequence[Any],
    tasks: list[tuple[Any, PassOptions]],
    work: Callable[[Any, PassOptions], Any],
    processes: int,
    fail_fast: bool = True,
) -> Iterator[tuple[Any, list[Any]]]:
    """Each of ``paths`` with ``work``'s results on its parts, in order: ``tasks`` are
    `plan.file_tasks`' (each file's parts, file by file), run on ``processes`` spawned processes;
    a part that fails is its `FileFailure` (raised with ``fail_fast``)."""
    parts = len(tasks) // max(len(paths), 1)
    results = iter(local_map(part_or_failure, tasks, processes, work, fail_fast))
    for path in paths:
        yield path, [next(results) for _ in range(parts)]


def first_failure(results: list[Any]) -> FileFailure | None:
    """The first `FileFailure` among a file's parts' ``results``, or None."""
    return next((result for result in results if isinstance(result, FileFailure)), None)


def sort_like(table: pl.DataFrame, paths: list[str]) -> pl.DataFrame:
    """Rows in the order of ``paths``, each file's rows in the order its pass produced them (a
    stable sort): the local engine's order."""

    if table.is_empty():
        return table
    order = {path: i for i, path in enumerate(paths)}
    rank = pl.col("file").replace_strict(order, default=len(paths), return_dtype=pl.Int64)
    return table.with_columns(rank.alias("__order")).sort("__order", maintain_order=True).drop("__order")
