"""`kvsnap stats` and `kvsnap outliers`: per-head statistics of one or many files, printed and saved."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat.io.outputs import output_path
from kvsnap.arguments import storage_options
from kvsnap.errors import CommandError, OptionsConflictError

from ..attention.head_importance import AttentionWarning, attention_stats, attention_table
from ..attention.names import SCALARS
from ..dependencies import pa, pl
from ..engine import batch, processes
from ..engine.files import FileFailure
from ..engine.parallel import cores
from ..engine.progress import bar as progress_bar
from ..kernels import DEFAULT as DEFAULT_KERNEL
from ..kernels import missing_note, profile
from ..stats.outliers import outliers
from .common import KEYS, FromArgs, ParquetSink, expanded, save_table, url_options, warnings_printed


def _progress(total: int) -> Callable[[str], None]:
    """A bar over the files (`progress.bar`, on stderr, off when stderr is not a terminal or for
    one file, whose pass shows its layers instead)."""

    bar = progress_bar(total, total > 1, unit="file")

    def progress(name: str) -> None:
        bar.set_postfix_str(name[-40:], refresh=False)
        bar.update()
        if bar.n >= total:
            bar.close()

    return progress


@dataclass(frozen=True)
class BatchRequest(FromArgs):
    """What a statistics command asks of the pass, typed, from its parsed options (`from_args`):
    the commands that read statistics share it, each parser declaring the options it offers and
    the rest keeping these defaults."""

    files: list[str] = dataclasses.field(default_factory=list)
    snapshot: int = -1
    keys: str = "post_rope"
    stats: frozenset[str] | None = None
    engine: str = "local"
    backend: str = DEFAULT_KERNEL
    jobs: int | None = None
    address: str | None = None
    fail_fast: bool = False
    storage_option: list[str] | None = None

    def storage_options(self) -> dict[str, Any] | None:
        """The ``--storage-option KEY=VALUE`` pairs as fsspec's options (None without any)."""
        return storage_options(self.storage_option)


@dataclass
class Statistics:
    """A batch's result as a command uses it: the rows (Arrow) and whether any file failed (the
    command's exit status is then 1)."""

    rows: Any
    failed: bool


@dataclass(frozen=True)
class StatsOptions(BatchRequest):
    """``kvsnap stats``'s options, typed (`from_args`): what the pass reads (`BatchRequest`) and
    what the command does with its rows."""

    factor: float = 1.5
    output: str | None = None
    merge: bool = False
    window: int = 256
    needle: tuple[int, int] | None = None
    retrieval: str | None = None
    force: bool = False


@dataclass(frozen=True)
class OutliersOptions(BatchRequest):
    """``kvsnap outliers``' options, typed (`from_args`): what the pass reads (`BatchRequest`)
    and which heads the command prints."""

    stat: str = "norm_mean"
    tensor: str = "k"
    threshold: float = 1.5


def _jobs(request: BatchRequest) -> int | None:
    """``--jobs``, or 1 for one local file on mlx that one process reads in one pass (workers
    would cost more to start than they save), or None: every core."""

    one_file = request.engine == "local" and request.jobs is None and len(request.files) == 1
    if profile(request.backend).device and one_file and processes.one_shot_in_process(request.files[0]):
        return 1
    return request.jobs


def _batch(request: BatchRequest, merge: bool = False, sink: Callable[[Any], None] | None = None) -> Any:
    """Statistics of every file or pattern, on the chosen engine; failures reported by file;
    ``sink`` (not with ``merge``) takes the rows' tables as they arrive (`batch.run_stats`)."""

    jobs = _jobs(request)
    workers = jobs or cores()
    note = missing_note(request.backend)
    if note:
        print(f"kvsnap: note: {note}", file=sys.stderr)
    backend, files = request.backend, request.files
    if request.engine == "local" and len(files) == 1 and processes.usable(files[0], workers, backend):
        # One big file (not a pattern): its workers start while the rest is imported.
        processes.start(processes.worker_count(workers, backend), backend)

    options = request.storage_options()
    try:
        expanded = batch.expand_paths(files, options)
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    run = batch.merged_stats if merge else functools.partial(batch.run_stats, sink=sink)
    result = run(
        expanded,
        engine=request.engine,
        jobs=jobs,
        address=request.address,
        fail_fast=request.fail_fast,
        snapshot=request.snapshot,
        keys=request.keys,
        stats=request.stats,
        storage_options=options,
        progress=_progress(len(expanded)),
        backend=backend,
    )
    report_failures(result.failures, result.files)
    return result


def report_failures(failures: list[FileFailure], files: int) -> None:
    """One line per failed file and a count on stderr; one file that failed alone is the
    command's one error line (`CommandError`, exit 1)."""
    if files == 1 and len(failures) == 1:
        raise CommandError(failures[0].error)
    for failure in failures:
        print(f"failed: {failure.file}: {failure.error}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} of {files} files failed", file=sys.stderr)


def statistics_rows(request: BatchRequest, sink: Callable[[Any], None] | None = None) -> Statistics:
    """The statistics of every file as an Arrow table, and whether any file failed (reported on
    stderr); ``sink`` as in `batch.run_stats`. `CommandError` where nothing came out."""
    result = _batch(request, sink=sink)
    if not result.rows.num_rows:
        raise CommandError("no statistics: every file failed or every layer is absent")
    return Statistics(result.rows, bool(result.failures))


def statistics_table(request: BatchRequest) -> tuple[Any, bool]:
    """`statistics_rows` as a Polars DataFrame, and whether any file failed."""

    found = statistics_rows(request)
    frame = pl.from_arrow(found.rows)
    assert isinstance(frame, pl.DataFrame)
    return frame, found.failed


def outliers_command(args: argparse.Namespace) -> int:
    """Heads whose statistic is more than ``--threshold`` times the median head of their file."""
    options = OutliersOptions.from_args(args)
    if options.stat in SCALARS:
        return _attention_outliers(options, args)
    table, failed = statistics_table(options)
    if options.stat not in table.columns or table.schema[options.stat] not in (
        pl.Float64,
        pl.Int64,
        pl.Float32,
    ):
        scalars = [c for c, t in table.schema.items() if t in (pl.Float64, pl.Int64) and c not in KEYS]
        raise CommandError(f"--stat must be a scalar statistic, one of: {', '.join(scalars)}")

    flagged = outliers(table, options.threshold, options.stat, options.tensor).filter(pl.col("outlier"))
    flagged = flagged.sort("ratio_to_median", descending=True)
    print(
        f"{flagged.height} heads with {options.tensor} {options.stat} above "
        f"{options.threshold}x the file's median head"
    )
    print(f"{'file':40s} {'seq':>3s} {'layer':>5s} {'head':>4s} {options.stat:>14s} {'x median':>9s}")
    for row in flagged.iter_rows(named=True):
        print(
            f"{row['file'][-40:]:40s} {row['seq']:3d} {row['layer']:5d} {row['head']:4d} "
            f"{row[options.stat]:14.4f} {row['ratio_to_median']:9.2f}"
        )
    return 1 if failed else 0


def _attention_outliers(options: OutliersOptions, args: argparse.Namespace) -> int:
    """`outliers --stat` of an attention score: query heads above ``--threshold`` x their file's
    median query head."""

    table = attention_stats(options.files, options.snapshot, storage_options=url_options(args))
    value = pl.col(options.stat).cast(pl.Float64).fill_nan(None)
    flagged = (
        table.with_columns((value / value.median().over("file")).alias("ratio_to_median"))
        .filter(pl.col("ratio_to_median") > options.threshold)
        .sort("ratio_to_median", descending=True)
    )
    print(
        f"{flagged.height} query heads with {options.stat} above {options.threshold}x "
        "the file's median query head"
    )
    print(f"{'file':40s} {'layer':>5s} {'head':>4s} {options.stat:>16s} {'x median':>9s}")
    for row in flagged.iter_rows(named=True):
        print(
            f"{row['file'][-40:]:40s} {row['layer']:5d} {row['head']:4d} "
            f"{row[options.stat]:16.4f} {row['ratio_to_median']:9.2f}"
        )
    return 0


def _merged(options: StatsOptions, args: argparse.Namespace) -> int:
    result = _batch(options, merge=True)
    table = result.table
    if options.output and not table.is_empty():
        save_table(table, options.output, args)
    if table.is_empty():
        raise CommandError("no statistics: every file failed or every layer is absent")

    if "norm_mean" not in table.columns:
        _medians(table.with_columns(pl.lit("merged").alias("file")))
        return 1 if result.failures else 0
    keys = table.filter(pl.col("tensor") == "k")
    files = keys["n_files"][0]
    print(f"mean ||K|| per layer and KV head over {files} files ({keys['n_tokens'].max()} tokens per head)")
    for layer in sorted(set(keys["layer"].to_list())):
        cells = [
            f"h{row['head']}={row['norm_mean']:7.2f}"
            for row in keys.filter(pl.col("layer") == layer).iter_rows(named=True)
        ]
        print(f"  layer {layer:3d}: " + "  ".join(cells))
    return 1 if result.failures else 0


def _medians(rows: Any) -> None:
    """Per file of the Arrow table ``rows``: the median over heads of each scalar statistic (NaN
    and null left out), for K and V."""
    scalars = _scalar_columns(rows.schema)
    for name, of_file in _by_file(rows.select(["file", "tensor", *scalars]).to_pylist()).items():
        print(f"{name}: {len(of_file)} head rows; median over heads")
        for tensor in ("k", "v"):
            part = [row for row in of_file if row["tensor"] == tensor]
            print(f"  {tensor.upper()}: " + "  ".join(_median_cells(part, scalars)))


def _scalar_columns(schema: Any) -> list[str]:
    """The numeric columns of an Arrow ``schema`` that are statistics (not `KEYS`)."""

    numeric = (pa.types.is_integer, pa.types.is_floating)
    return [f.name for f in schema if any(t(f.type) for t in numeric) and f.name not in KEYS]


def _median_cells(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    """``column=median`` of each of ``columns`` over ``rows`` (NaN and null left out)."""
    return [f"{column}={_median_of(rows, column):.4g}" for column in columns]


def stats_command(args: argparse.Namespace) -> int:
    options = StatsOptions.from_args(args)
    # Printed and saved from Arrow: polars' import is left to the commands that need it.
    if options.stats == frozenset({"attention"}):
        return _attention_stats(options, args)
    if options.stats == frozenset({"state"}):
        return _state_stats(options, args)
    for option, value in (("--needle", options.needle), ("--retrieval", options.retrieval)):
        if value is not None:
            raise OptionsConflictError(f"{option} scores attention: use it with --stats attention")
    if options.merge:
        return _merged(options, args)
    found = _statistics_saved(options, args)
    rows = found.rows
    if "norm_mean" not in rows.column_names:  # --stats without norms: medians of what was computed
        _medians(rows)
    else:
        _print_files(key_rows(rows, options.factor), options.factor)
    return 1 if found.failed else 0


def _statistics_saved(options: StatsOptions, args: argparse.Namespace) -> Any:
    """The statistics rows of every file, saved to ``-o`` where one is given: a CSV once every
    file is done, Parquet as the files finish (the output checked before any work)."""
    request: BatchRequest = options
    if options.output and options.output.lower().endswith(".csv"):
        found = statistics_rows(request)
        save_table(found.rows, options.output, args)
    elif options.output:
        with output_path(options.output, inputs=expanded(request.files), force=options.force) as temporary:
            sink = ParquetSink(temporary)
            found = statistics_rows(request, sink.add)
            sink.finish(found.rows)
        print(f"wrote {options.output}: {len(found.rows)} rows")
    else:
        found = statistics_rows(request)
    return found


def _print_files(keys: list[dict[str, Any]], factor: float) -> None:
    """Each file's K rows (`key_rows`): one file's heads in full, several files a line each."""
    files = _by_file(keys)
    for name, of_file in files.items():
        if len(files) == 1:
            _print_norms(name, of_file, factor)
        else:
            _print_file_line(name, of_file, factor)


def key_rows(rows: Any, factor: float) -> list[dict[str, Any]]:
    """The K rows of the Arrow table ``rows`` as dicts (``file``, ``seq``, ``layer``, ``head``,
    ``n_tokens``, ``norm_mean``) with ``ratio_to_median`` (``norm_mean`` over the median K head of
    its file; None where either is NaN or null) and ``outlier`` (the ratio above ``factor``): what
    `analysis.stats.outliers.outliers` computes, without polars."""
    columns = ["file", "seq", "layer", "head", "n_tokens", "norm_mean", "tensor"]
    # Filtered in Python: pyarrow.compute's first call imports pandas where it is there.
    keys = [row for row in rows.select(columns).to_pylist() if row["tensor"] == "k"]
    medians = {name: _median_of(of_file, "norm_mean") for name, of_file in _by_file(keys).items()}
    for row in keys:
        value, median = _number(row["norm_mean"]), medians[row["file"]]
        ratio = None if value is None or math.isnan(median) else _divide(value, median)
        row["ratio_to_median"] = ratio
        row["outlier"] = ratio is not None and ratio > factor
    return keys


def _by_file(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``rows`` grouped by their ``file``, files and rows in the order given."""
    found: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        found.setdefault(row["file"], []).append(row)
    return found


def _number(value: Any) -> float | None:
    """``value`` as a float; None for a null or NaN (a statistic no row could give)."""
    return None if value is None or math.isnan(value) else float(value)


def _median_of(rows: list[dict[str, Any]], column: str) -> float:
    """The median of ``column`` over ``rows``, NaN and null left out (NaN when none is left)."""

    values = [v for row in rows if (v := _number(row[column])) is not None]
    return float(np.median(values)) if values else math.nan


def _divide(value: float, median: float) -> float:
    """``value / median`` as IEEE division gives it (inf or NaN for a zero median)."""
    if median:
        return value / median
    return math.nan if value == 0 else math.copysign(math.inf, value)


def _by_ratio(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` by ``ratio_to_median``, largest first, those without one last."""
    return sorted(rows, key=lambda row: (row["ratio_to_median"] is None, -(row["ratio_to_median"] or 0.0)))


def _ratio(row: dict[str, Any]) -> str:
    ratio = row["ratio_to_median"]
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _print_file_line(name: str, rows: list[dict[str, Any]], factor: float) -> None:
    """One file of several in one line: its tokens, the median over heads of mean ||K||, how
    many heads are above ``factor`` x that median, and the largest."""
    top = _by_ratio(rows)[0]
    median = _median_of(rows, "norm_mean")
    print(
        f"{name}: {max(row['n_tokens'] for row in rows)} tokens, mean ||K|| median {median:.2f}, "
        f"{sum(row['outlier'] for row in rows)} heads above {factor}x, largest layer {top['layer']} head "
        f"{top['head']} ({_ratio(top)})"
    )


def _print_norms(name: str, rows: list[dict[str, Any]], factor: float) -> None:
    """One file's mean ||K|| per layer and head, outliers starred, and its three largest heads."""
    counts = [row["n_tokens"] for row in rows]
    low, high = min(counts), max(counts)
    held = f"{high} tokens" if low == high else f"{high} tokens; uneven: heads hold {low} to {high}"
    print(f"{name}: mean ||K|| per layer and KV head ({held}; * = above {factor}x the median head)")
    for layer in sorted({row["layer"] for row in rows}):
        cells = [
            f"h{row['head']}={_cell(row['norm_mean'])}{'*' if row['outlier'] else ' '}"
            for row in rows
            if row["layer"] == layer and row["seq"] == 0
        ]
        print(f"  layer {layer:3d}: " + "  ".join(cells))
    largest = ", ".join(
        f"layer {row['layer']} head {row['head']} ({_ratio(row)} median)" for row in _by_ratio(rows)[:3]
    )
    print(f"  largest: {largest}")


def _cell(value: float | None) -> str:
    return f"{value:7.2f}" if value is not None else "   null"


def _attention_stats(options: StatsOptions, args: argparse.Namespace) -> int:
    """``stats --stats attention``: per (layer, query head) scores from saved queries, printed and
    saved from Arrow (no polars import, as for the other groups)."""

    failures: list[FileFailure] = []
    with warnings_printed(AttentionWarning):
        table = attention_table(
            options.files,
            options.snapshot,
            window=options.window,
            needle=options.needle,
            retrieval=options.retrieval or "generated",
            storage_options=url_options(args),
            failures=failures,
        )
    files = len(set(table.column("file").to_pylist())) + len(failures) if table.num_rows else len(failures)
    report_failures(failures, files)
    if not table.num_rows:
        raise CommandError("no attention statistics: every file failed")
    if options.output:
        save_table(table, options.output, args)
    _attention_summary(table, options.window)
    return 1 if failures else 0


def _state_stats(options: StatsOptions, args: argparse.Namespace) -> int:
    """``stats --stats state``: per recurrent state array and snapshot (`tools.state`); every
    snapshot of a series unless ``--snapshot N`` (N >= 0) names one."""
    from ..tools.state import state_table

    failures: list[FileFailure] = []
    snapshot = None if options.snapshot == -1 else options.snapshot
    table = state_table(options.files, snapshot, storage_options=url_options(args), failures=failures)
    files = len(set(table.column("file").to_pylist())) + len(failures)
    report_failures(failures, files)
    if not table.num_rows:
        raise CommandError("no recurrent state statistics: every file failed")
    if options.output:
        save_table(table, options.output, args)
    _state_summary(table)
    return 1 if failures else 0


def _state_summary(table: Any) -> None:
    """Per (layer, slot) of the last snapshot: norm, effective rank and change (mean over heads)."""
    rows = table.to_pylist()
    last = max(row["snapshot"] for row in rows)
    snapshots = len({row["snapshot"] for row in rows})
    print(f"recurrent state of {snapshots} snapshot(s); snapshot {last}, mean over heads and sequences:")
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for row in rows:
        if row["snapshot"] == last:
            groups.setdefault((row["file"], row["layer"], row["slot"]), []).append(row)
    several = len({key[0] for key in groups}) > 1
    for (name, layer, _), found in groups.items():
        print(_state_line(f"{os.path.basename(name)}: " if several else "", layer, found))


def _state_line(where: str, layer: int, found: list[dict[str, Any]]) -> str:
    """One (layer, slot)'s line of `_state_summary`: its rows' means, NaNs counted."""
    changes = [r["change"] for r in found if r["change"] is not None]
    change = f", change {sum(changes) / len(changes):.3g}" if changes else ""
    bad = sum(r["nonfinite_values"] for r in found)
    flagged = f", {bad} NON-FINITE values" if bad else ""
    shape = f"{len(found)} x {found[0]['rows']}x{found[0]['cols']}"
    return (
        f"  {where}layer {layer:3d} {found[0]['role']:<12} {shape}: "
        f"norm {sum(r['norm'] for r in found) / len(found):.4g}, effective rank "
        f"{sum(r['effective_rank'] for r in found) / len(found):.3g}{change}{flagged}"
    )


def _highest(rows: list[dict[str, Any]], column: str, several: bool) -> str:
    """The five query heads of highest ``column`` (``L3.H1=0.842``, named with their file where
    there are ``several``); NaNs and trivial streaming errors left out, ties in order."""
    scored = [row for row in rows if row[column] is not None and not math.isnan(row[column])]
    if column == "streaming_error":
        scored = [row for row in scored if not row["streaming_trivial"]]
    ranked = sorted(scored, key=lambda row: row[column], reverse=True)[:5]
    where = (lambda r: f"{os.path.basename(r['file'])}:") if several else (lambda r: "")
    return ", ".join(f"{where(r)}L{r['layer']}.H{r['head']}={r[column]:.3f}" for r in ranked)


def _attention_summary(table: Any, window: int) -> None:
    """The heads with the highest sink mass, retrieval and streaming error (named with their file
    where there are several); trivial streaming errors (nothing outside the window) left out."""
    scores = ["sink_mass", "retrieval_score", "streaming_error", "streaming_trivial"]
    rows = table.select(["file", "layer", "head", *scores]).to_pylist()
    files = len({row["file"] for row in rows})
    several = files > 1
    print(
        f"attention of {len(rows)} query heads{f' in {files} files' if several else ''} "
        f"(per layer and query head; {window}-position window)"
    )
    for column, label in (
        ("sink_mass", "sink mass"),
        ("retrieval_score", "retrieval score"),
        ("streaming_error", "streaming error"),
    ):
        cells = _highest(rows, column, several)
        if not cells and column == "streaming_error":
            cells = (
                f"none to rank: every query sees only the sinks and the last {window} positions, "
                "so dropping the rest changes nothing (0 by construction; a smaller --window)"
            )
        print(f"  highest {label}: {cells or 'none (no events)'}")
