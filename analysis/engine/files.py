"""What the batch engines share: their options (`BatchOptions`), file patterns, per-file
failures, the result of a batch.

`analysis.engine.batch` (the entry points) uses this module and, when asked for Ray, `analysis.engine.ray`;
`analysis.engine.ray` uses this module and `analysis.stats`. Nothing here imports either engine, so the
dependencies run one way: batch -> ray -> files, stats.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvformat.io.remote import expand, is_url

from ..dependencies import pa, pl
from ..kernels import profile
from .parallel import cores, local_map, split_jobs
from .plan import FileOptions, PassOptions

if TYPE_CHECKING:
    from .plan import PassOptions

Options = dict[str, Any]
MergedKey = tuple[int, int, str]  # (layer, head, "k" | "v")


ENGINES = ("local", "ray")


@dataclass(frozen=True)
class BatchOptions(FileOptions):
    """How a batch job over many files runs: one object for `analysis.engine.batch.run_stats`,
    `analysis.engine.batch.merged_stats` and the Ray engine; each file's pass as `FileOptions`
    says (``snapshot``, ``keys``, ``stats``, ``storage_options``, ``backend``).

    ``engine``: ``"local"`` (processes on this machine) or ``"ray"``; ``jobs``: cores (local) or
    CPUs of a local Ray cluster, default all of this process's; ``address``: a Ray cluster to
    join; ``fail_fast``: raise on the first failing file instead of collecting it."""

    engine: str = "local"
    jobs: int | None = None
    address: str | None = None
    fail_fast: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be 'local' or 'ray', not {self.engine!r}")
        if self.jobs is not None and (not isinstance(self.jobs, int) or self.jobs < 1):
            raise ValueError(f"jobs must be a positive integer, not {self.jobs!r}")

    @classmethod
    def of(cls, options: BatchOptions | None, settings: dict[str, Any]) -> BatchOptions:
        """``options`` (default: the defaults) with the keyword ``settings`` applied; TypeError
        naming a setting that is not a field."""
        shared = [f.name for f in dataclasses.fields(FileOptions)]
        known = [f.name for f in dataclasses.fields(cls) if f.name not in shared] + shared
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise TypeError(f"unknown batch option {unknown[0]!r}; known: {', '.join(known)}")
        return dataclasses.replace(options or cls(), **settings)

    @property
    def cores(self) -> int:
        """``jobs``, or every core this process may use."""

        return self.jobs or cores()

    def plan(self, files: int) -> tuple[int, PassOptions]:
        """Processes for ``files`` files and each file's pass options: files in parallel first,
        the cores left as each file's workers. With ``backend="mlx"`` the device is driven by
        `kernels.mlx_sizing.processes` processes (12 of 16 cores): with at least as many files,
        each drives it with whole files, one after another (one file's pass in each, its copy and
        row threads a share of the machine's); with fewer, one file after another, each on that
        many worker processes (a local file; else one thread)."""

        processes, threads = split_jobs(self.cores, files)
        share = 1
        kernel = profile(self.backend)
        if kernel.device:  # each process drives the device
            share = kernel.processes(self.cores)
            if files >= share > 1:
                processes, threads = share, 1
            else:
                processes, threads, share = 1, self.cores, 1
        options = PassOptions(
            snapshot=self.snapshot,
            keys=self.keys,
            stats=self.stats,
            workers=threads,
            storage_options=self.storage_options,
            progress=files == 1,
            backend=self.backend,
            device_share=share,
        )
        return processes, options


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


PART_TASKS_PER_PROCESS = 8
MAX_PARTS = 8


def file_parts(files: int, cores: int, options: PassOptions) -> int:
    """Into how many parts (contiguous shares of its layers, `PassOptions.part`) a batch splits
    each file: where ``options`` gives each file one core (the CPU backend, more files than half
    the cores), about `PART_TASKS_PER_PROCESS` tasks per process, at most `MAX_PARTS` per file,
    so that the last files end together on every core (50 files on 16 cores: 3 parts; 9 files: 8
    parts on 16 processes, where whole files left 7 cores idle). Else 1."""
    if not profile(options.backend).splits_files or options.workers > 1 or cores <= 1 or files < 1:
        return 1
    return max(1, min(MAX_PARTS, -(-PART_TASKS_PER_PROCESS * cores // files)))


def part_or_failure(
    task: tuple[str, tuple[int, int]],
    work: Callable[[str, PassOptions], Any],
    options: PassOptions,
    fail_fast: bool,
) -> Any:
    """`file_or_failure` of one part of a file: ``task`` is ``(path, (index, count))``, the part
    as `PassOptions.part` takes it."""
    path, part = task
    return file_or_failure(path, work, dataclasses.replace(options, part=part), fail_fast)


def parts_by_file(
    paths: Sequence[Any],
    work: Callable[[Any, PassOptions], Any],
    processes: int,
    options: PassOptions,
    cores: int,
    fail_fast: bool = True,
) -> Iterator[tuple[Any, list[Any]]]:
    """Each of ``paths`` with ``work``'s results on its parts (`part_or_failure`: a part that
    fails is its `FileFailure`, raised with ``fail_fast``), in order, on ``processes`` spawned
    processes: files handed out in parts where each would get one core (`file_parts`; every
    one of ``cores`` then)."""

    parts = file_parts(len(paths), cores, options)
    if parts > 1:
        processes = min(cores, len(paths) * parts)
    tasks = [(path, (index, parts)) for path in paths for index in range(parts)]
    results = iter(local_map(part_or_failure, tasks, processes, work, options, fail_fast))
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
