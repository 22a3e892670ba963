"""What the batch engines share: file patterns, per-file failures, the result of a batch.

`analysis.batch` (the entry points) uses this module and, when asked for Ray, `analysis.ray`;
`analysis.ray` uses this module and `analysis.stats`. Nothing here imports either engine, so the
dependencies run one way: batch -> ray -> files, stats.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvformat.remote import expand, is_url

if TYPE_CHECKING:
    import polars as pl

    from kvsnap.analysis.streaming import PassOptions

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
    path: str, work: Callable[[str, PassOptions], Any], options: PassOptions, fail_fast: bool
) -> Any:
    """``work(path, options)``, or the `FileFailure` it raised (raised again with
    ``fail_fast``). ``path`` first, as `analysis.stats.local_map` calls it."""
    try:
        return work(path, options)
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
