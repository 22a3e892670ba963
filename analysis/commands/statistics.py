"""`kvsnap stats` and `kvsnap outliers`: per-head statistics of one or many files, printed and saved."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from .common import KEYS, save_parquet, url_options


def _progress(total: int) -> Callable[[str], None]:
    """A bar over the files (tqdm, on stderr, off when stderr is not a terminal or for one file,
    whose pass shows its layers instead)."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="file", file=sys.stderr, disable=None if total > 1 else True, leave=False)

    def progress(name: str) -> None:
        bar.set_postfix_str(name[-40:], refresh=False)
        bar.update()
        if bar.n >= total:
            bar.close()

    return progress


def _jobs(args: argparse.Namespace, engine: str, backend: str) -> int | None:
    """``--jobs``, or 1 for one local file on mlx that one process reads in one pass (workers
    would cost more to start than they save), or None: every core."""
    from .. import processes

    one_file = engine == "local" and args.jobs is None and len(args.files) == 1
    if backend == "mlx" and one_file and processes.one_shot_in_process(args.files[0]):
        return 1
    return args.jobs


def _batch(args: argparse.Namespace, merge: bool = False) -> Any:
    """Statistics of every file or pattern, on the chosen engine; failures reported by file."""
    from .. import processes
    from ..parallel import cores

    engine, backend = getattr(args, "engine", "local"), getattr(args, "backend", "cpu")
    jobs = _jobs(args, engine, backend)
    workers = jobs or cores()
    if engine == "local" and len(args.files) == 1 and processes.usable(args.files[0], workers, backend):
        # One big file (not a pattern): its workers start while the rest is imported.
        processes.start(processes.worker_count(workers, backend), backend)
    from ..batch import expand_paths, merged_stats, run_stats

    options = url_options(args)
    try:
        files = expand_paths(args.files, options)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    run = merged_stats if merge else run_stats
    result = run(
        files,
        engine=engine,
        jobs=jobs,
        address=getattr(args, "address", None),
        fail_fast=getattr(args, "fail_fast", False),
        snapshot=args.snapshot,
        keys=args.keys,
        stats=getattr(args, "stats", None),
        storage_options=options,
        progress=_progress(len(files)),
        backend=backend,
    )
    for failure in result.failures:
        print(f"failed: {failure.file}: {failure.error}", file=sys.stderr)
    if result.failures:
        print(f"{len(result.failures)} of {result.files} files failed", file=sys.stderr)
    return result


def statistics_table(args: argparse.Namespace) -> Any:
    """The statistics table of every file (failures reported on stderr, exit status 1 later)."""
    result = _batch(args)
    args.failed = bool(result.failures)
    if result.table.is_empty():
        raise SystemExit("no statistics: every file failed or every layer is absent")
    return result.table


def outliers_command(args: argparse.Namespace) -> int:
    """Heads whose statistic is more than ``--threshold`` times the median head of their file."""
    import polars as pl

    table = statistics_table(args)
    if args.stat not in table.columns or table.schema[args.stat] not in (pl.Float64, pl.Int64, pl.Float32):
        scalars = [c for c, t in table.schema.items() if t in (pl.Float64, pl.Int64) and c not in KEYS]
        raise SystemExit(f"--stat must be a scalar statistic, one of: {', '.join(scalars)}")
    from ..stats import outliers

    flagged = outliers(table, args.threshold, args.stat, args.tensor).filter(pl.col("outlier"))
    flagged = flagged.sort("ratio_to_median", descending=True)
    print(
        f"{flagged.height} heads with {args.tensor} {args.stat} above "
        f"{args.threshold}x the file's median head"
    )
    print(f"{'file':40s} {'seq':>3s} {'layer':>5s} {'head':>4s} {args.stat:>14s} {'x median':>9s}")
    for row in flagged.iter_rows(named=True):
        print(
            f"{row['file'][-40:]:40s} {row['seq']:3d} {row['layer']:5d} {row['head']:4d} "
            f"{row[args.stat]:14.4f} {row['ratio_to_median']:9.2f}"
        )
    return 1 if args.failed else 0


def _merged(args: argparse.Namespace) -> int:
    result = _batch(args, merge=True)
    table = result.table
    if args.output and not table.is_empty():
        save_parquet(table, args.output, args)
    if table.is_empty():
        raise SystemExit("no statistics: every file failed or every layer is absent")
    import polars as pl

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


def _medians(table: Any) -> None:
    """Per file: the median over heads of each scalar statistic, for K and V."""
    import polars as pl

    scalars = [c for c, t in table.schema.items() if t.is_numeric() and c not in KEYS]
    for name in table["file"].unique(maintain_order=True).to_list():
        rows = table.filter(pl.col("file") == name)
        print(f"{name}: {rows.height} head rows; median over heads")
        for tensor in ("k", "v"):
            part = rows.filter(pl.col("tensor") == tensor)
            cells = [f"{c}={part[c].median():.4g}" for c in scalars]
            print(f"  {tensor.upper()}: " + "  ".join(cells))


def stats_command(args: argparse.Namespace) -> int:
    import polars as pl

    from ..stats import outliers

    if args.stats == frozenset({"attention"}):
        return _attention_stats(args)
    if args.merge:
        return _merged(args)
    table = statistics_table(args)
    if args.output:
        save_parquet(table, args.output, args)
    if "norm_mean" not in table.columns:  # --stats without norms: medians of what was computed
        _medians(table)
        return 1 if args.failed else 0
    flagged = outliers(table, args.factor)
    names = flagged["file"].unique(maintain_order=True).to_list()
    for name in names:
        rows = flagged.filter(pl.col("file") == name)
        if len(names) == 1:
            _print_norms(name, rows, args.factor)
        else:
            _print_file_line(name, rows, args.factor)
    return 1 if args.failed else 0


def _print_file_line(name: str, rows: Any, factor: float) -> None:
    """One file of several in one line: its tokens, the median over heads of mean ||K||, how
    many heads are above ``factor`` x that median, and the largest."""
    import polars as pl

    keys = rows.filter(pl.col("tensor") == "k")
    top = rows.sort("ratio_to_median", descending=True).row(0, named=True)
    print(
        f"{name}: {keys['n_tokens'].max()} tokens, mean ||K|| median {keys['norm_mean'].median():.2f}, "
        f"{int(rows['outlier'].sum())} heads above {factor}x, largest layer {top['layer']} head "
        f"{top['head']} ({top['ratio_to_median']:.2f}x)"
    )


def _print_norms(name: str, rows: Any, factor: float) -> None:
    """One file's mean ||K|| per layer and head, outliers starred, and its three largest heads."""
    import polars as pl

    counts = rows.filter(pl.col("tensor") == "k")["n_tokens"].to_list()
    low, high = min(counts), max(counts)
    held = f"{high} tokens" if low == high else f"{high} tokens; uneven: heads hold {low} to {high}"
    print(f"{name}: mean ||K|| per layer and KV head ({held}; * = above {factor}x the median head)")
    for layer in sorted(set(rows["layer"].to_list())):
        cells = [
            f"h{row['head']}={row['norm_mean']:7.2f}{'*' if row['outlier'] else ' '}"
            for row in rows.filter((pl.col("layer") == layer) & (pl.col("seq") == 0)).iter_rows(named=True)
        ]
        print(f"  layer {layer:3d}: " + "  ".join(cells))
    top = rows.sort("ratio_to_median", descending=True).head(3)
    largest = ", ".join(
        f"layer {r['layer']} head {r['head']} ({r['ratio_to_median']:.2f}x median)"
        for r in top.iter_rows(named=True)
    )
    print(f"  largest: {largest}")


def _attention_stats(args: argparse.Namespace) -> int:
    """``stats --stats attention``: per (layer, query head) scores from saved queries."""
    import polars as pl

    from ..head_importance import attention_stats

    table = attention_stats(
        args.files,
        args.snapshot,
        window=args.window,
        needle=args.needle,
        storage_options=url_options(args),
    )
    if args.output:
        save_parquet(table, args.output, args)
    print(
        f"attention of {table.height} query heads (per layer and query head; {args.window}-position window)"
    )
    for column, label in (
        ("sink_mass", "sink mass"),
        ("retrieval_score", "retrieval score"),
        ("streaming_error", "streaming error"),
    ):
        ranked = table.filter(pl.col(column).is_not_nan()).sort(column, descending=True).head(5)
        cells = ", ".join(f"L{r['layer']}.H{r['head']}={r[column]:.3f}" for r in ranked.iter_rows(named=True))
        print(f"  highest {label}: {cells or 'none (no events)'}")
    return 0
