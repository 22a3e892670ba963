"""What a batch does beside its plan (`plan.BatchOptions.plan`): file patterns, carrying a plan's
tasks out on its executor (`parts_by_file`), per-file failures, the result of a batch.

`analysis.engine.batch` (the entry points) and `analysis.engine.ray` (Ray Data's reader) use this
module; it imports neither.
"""

from __future__ import annotations

import functools
import glob
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvformat import KVSnapError
from kvformat.io.remote import expand, is_url

from ..dependencies import pa, pl

if TYPE_CHECKING:
    from .plan import PassOptions, Plan

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
    """``work(path, options)``, or the `FileFailure` of what it refused (a `KVSnapError`: a file
    that is not valid, a request it cannot answer) or of the operating system's error (raised
    again with ``fail_fast``). Any other exception is a bug in kvsnap and is raised as it is."""
    try:
        return work(path, options)
    except (KVSnapError, OSError) as exc:
        if fail_fast:
            raise
        return FileFailure(path, describe_error(exc))


def part_or_failure(
    task: tuple[Any, PassOptions], work: Callable[[Any, PassOptions], Any], fail_fast: bool
) -> Any:
    """`file_or_failure` of one of `plan.Plan.tasks`: ``(path, the part's options)``."""
    path, options = task
    return file_or_failure(path, work, options, fail_fast)


def parts_by_file(
    plan: Plan, work: Callable[[Any, PassOptions], Any], fail_fast: bool = True
) -> Iterator[tuple[Any, list[Any]]]:
    """Each of the plan's paths with ``work``'s results on its parts, in order, the plan's tasks
    run on its executor (`plan.Plan.start`); a part that fails is its `FileFailure` (raised
    with ``fail_fast``)."""
    with plan.start() as executor:
        results = executor.map(part_or_failure, plan.tasks, work, fail_fast)
        for path in plan.paths:
            yield path, [next(results) for _ in range(plan.parts)]


def first_failure(results: list[Any]) -> FileFailure | None:
    """The first `FileFailure` among a file's parts' ``results``, or None."""
    return next((result for result in results if isinstance(result, FileFailure)), None)
