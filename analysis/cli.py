"""Analysis commands: `kvsnap stats`, `outliers`, `plot`, `similarity`."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from kvformat.arguments import non_negative_int, positive_float, positive_int, storage_options
from kvformat.outputs import check_output, output_path

KEYS = ("snapshot", "seq", "layer", "head", "n_tokens")


def _inputs(args: argparse.Namespace) -> list[str]:
    """The local files a command reads (patterns expanded), to keep its outputs off them."""
    import glob

    names = [getattr(args, name) for name in ("file", "a", "b") if getattr(args, name, None)]
    names += list(getattr(args, "files", None) or [])
    found: list[str] = []
    for name in names:
        found.append(name)
        if "://" not in name and glob.has_magic(name):
            found += glob.glob(name, recursive=True)
    return found


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Before any work: every output the command will write is allowed (`kvformat.outputs`), a
    ``--stat`` names a statistic the selected groups compute, and ``--snapshot`` is inside each
    local file named (reading only its index)."""
    del parser
    stat = getattr(args, "stat", None)
    from .head_importance import SCALARS

    attention_heatmap = args.func is _plot and stat in SCALARS  # from saved queries, checked there
    if stat is not None and getattr(args, "attention", None) is None and not attention_heatmap:
        from .catalogue import check_scalar, stat_groups

        check_scalar(stat, stat_groups(getattr(args, "stats", None)))
    _check_snapshot(args)
    for option in ("output", "plot"):
        path = getattr(args, option, None)
        if path:
            folder = option == "output" and args.func is _export
            check_output(path, inputs=_inputs(args), force=args.force, folder=folder)
    if getattr(args, "output", None) and getattr(args, "plot", None):
        from kvformat.outputs import same_file

        if same_file(args.output, args.plot):
            raise ValueError(f"-o and --plot name the same file {args.output}")


def _check_snapshot(args: argparse.Namespace) -> None:
    """`kvformat.OutOfRangeError` (one line, exit 2) for a ``--snapshot`` outside a local file."""
    import glob

    import kvformat

    snapshot = getattr(args, "snapshot", None)
    if snapshot is None or snapshot == -1:
        return
    names = [getattr(args, "file", None), *(getattr(args, "files", None) or [])]
    for name in names:
        if name and "://" not in name and not glob.has_magic(name) and os.path.isfile(name):
            try:
                kvformat.open(name, snapshot).close()
            except kvformat.KVFormatError:
                return  # a bad file: the command reports it as it does any other


def _save_parquet(table: Any, path: str, args: argparse.Namespace) -> None:
    """Write ``table`` to ``path`` through a temporary name; say where."""
    with output_path(path, inputs=_inputs(args), force=args.force) as temporary:
        table.write_parquet(temporary)
    print(f"wrote {path}: {table.height} rows")


def _save_figure(figure: Any, path: str, args: argparse.Namespace) -> None:
    """Save ``figure`` as PNG at exactly ``path`` (matplotlib would add ``.png`` to a bare name)."""
    with output_path(path, inputs=_inputs(args), force=args.force) as temporary:
        figure.savefig(temporary, dpi=110, format="png")


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    return storage_options(getattr(args, "storage_option", None))


def stat_groups_type(text: str) -> frozenset[str]:
    """argparse type: comma-separated statistic groups (``all``, ``norms``, ``channels``, ...)."""
    from .catalogue import stat_groups

    named = {name.strip() for name in text.split(",")}
    if "attention" in named:
        if named != {"attention"}:
            raise argparse.ArgumentTypeError(
                "attention rows are per query head, the other groups' per KV head: "
                "ask for --stats attention on its own"
            )
        return frozenset({"attention"})
    try:
        return stat_groups(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def _batch(args: argparse.Namespace, merge: bool = False) -> Any:
    """Statistics of every file or pattern, on the chosen engine; failures reported by file."""
    from . import processes
    from .parallel import cores

    jobs = args.jobs
    engine, backend = getattr(args, "engine", "local"), getattr(args, "backend", "cpu")
    if (
        backend == "mlx"
        and engine == "local"
        and jobs is None
        and len(args.files) == 1
        and processes.one_shot_in_process(args.files[0])
    ):
        jobs = 1  # one pass, then the command ends: workers would cost more to start than they save
    workers = jobs or cores()
    if engine == "local" and len(args.files) == 1 and processes.usable(args.files[0], workers, backend):
        # One big file (not a pattern): its workers start while the rest is imported.
        processes.start(processes.worker_count(workers, backend), backend)
    from .batch import expand_paths, merged_stats, run_stats

    options = _storage_options(args)
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


def _table(args: argparse.Namespace) -> Any:
    """The statistics table of every file (failures reported on stderr, exit status 1 later)."""
    result = _batch(args)
    args.failed = bool(result.failures)
    if result.table.is_empty():
        raise SystemExit("no statistics: every file failed or every layer is absent")
    return result.table


def _outliers(args: argparse.Namespace) -> int:
    """Heads whose statistic is more than ``--threshold`` times the median head of their file."""
    import polars as pl

    table = _table(args)
    if args.stat not in table.columns or table.schema[args.stat] not in (pl.Float64, pl.Int64, pl.Float32):
        scalars = [c for c, t in table.schema.items() if t in (pl.Float64, pl.Int64) and c not in KEYS]
        raise SystemExit(f"--stat must be a scalar statistic, one of: {', '.join(scalars)}")
    from .stats import outliers

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


def _plot(args: argparse.Namespace) -> int:
    """A layers x heads heatmap of one statistic and per-position norm curves, as one PNG: a title
    naming file, model, snapshot and statistic; labelled colour scales; the prompt/generation
    boundary; token labels on request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import polars as pl
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    import kvformat

    from .stats import token_table

    if args.attention is not None:
        return _attention_map(args)
    from .head_importance import SCALARS

    if args.stat in SCALARS:
        return _attention_stat_plot(args)
    args.files = [args.file]
    table = _table(args).filter((pl.col("tensor") == args.tensor) & (pl.col("seq") == 0))
    numeric = [
        c for c, t in table.schema.items() if t.is_numeric() and c not in ("seq", "layer", "head", "snapshot")
    ]
    if args.stat not in numeric:
        raise SystemExit(f"unknown statistic {args.stat!r}; one of: {', '.join(numeric)}")
    layers, grid = _layer_head_grid(table, args.stat)
    heads = grid.shape[1]
    options = _storage_options(args)
    with kvformat.open(args.file, args.snapshot, storage_options=options) as snap:
        index, count, seq_len = snap.index, snap.num_snapshots, snap.seq_len
        generated = snap.snapshot_metadata.get("generated")
        model = snap.metadata.get("model", {})
    model_name = model.get("name") if isinstance(model, dict) else None
    tokens = (
        token_table(args.file, args.snapshot, options)
        .filter(pl.col("seq") == 0)
        .group_by("layer", "position")
        .agg(pl.col(f"{args.tensor}_norm").mean(), pl.col("token_text").first())
        .sort("layer", "position")
        .collect()
    )
    curves, width = _binned_positions(tokens, f"{args.tensor}_norm")
    name = f"{args.tensor.upper()} {args.stat}"
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    figure.suptitle(
        f"{os.path.basename(args.file)}  |  model {model_name or '(not recorded)'}  |  "
        f"snapshot {index} (of 0..{count - 1})  |  {name}",
        fontsize=11,
    )
    image = left.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    left.set_xlabel("KV head")
    left.set_xticks(range(heads))
    left.set_ylabel("layer")
    step = max(1, len(layers) // 16)
    left.set_yticks(range(0, len(layers), step), [str(layer) for layer in layers[::step]])
    left.set_title(f"{name} per layer and head")
    figure.colorbar(image, ax=left, label=name)
    colors = plt.get_cmap("viridis")
    scale = Normalize(min(layers), max(layers)) if layers else Normalize(0, 1)
    for layer in layers:
        part = curves.filter(pl.col("layer") == layer)
        right.plot(part["position"], part[f"{args.tensor}_norm"], color=colors(scale(layer)), lw=0.8)
    figure.colorbar(ScalarMappable(scale, colors), ax=right, label="layer")
    if isinstance(generated, int) and 0 < generated <= seq_len:
        boundary = seq_len - generated  # the first generated token's position
        right.axvline(boundary - 0.5, color="crimson", ls="--", lw=1)
        right.annotate(
            "prompt | generated",
            (boundary - 0.5, 1.0),
            xycoords=("data", "axes fraction"),
            ha="center",
            va="bottom",
            color="crimson",
            fontsize=8,
        )
    right.set_xlabel("position")
    right.set_ylabel(f"mean ||{args.tensor.upper()}|| over heads")
    binned = f", mean of {width} positions per point" if width > 1 else ""
    right.set_title(f"||{args.tensor.upper()}|| by position, one line per layer{binned}", pad=14)
    if args.token_labels:
        first = tokens.filter(pl.col("layer") == layers[0]) if layers else tokens
        labelled = [
            (p, t) for p, t in zip(first["position"], first["token_text"], strict=True) if t is not None
        ]
        if not labelled:
            print("note: the file records no token text; plotting without token labels", file=sys.stderr)
        else:
            every = max(1, len(labelled) // 60)
            shown = labelled[::every]
            right.set_xticks(
                [p for p, _ in shown], [repr(t)[1:-1][:12] for _, t in shown], rotation=90, fontsize=6
            )
    figure.tight_layout()
    _save_figure(figure, args.output, args)
    plt.close(figure)
    print(f"wrote {args.output}: {len(layers)} layers x {heads} heads, {curves.height} position points")
    return 0


def _layer_head_grid(table: Any, stat: str) -> tuple[list[int], Any]:
    """The layers of ``table`` and its ``stat`` as a ``(layers, heads)`` array (NaN where absent)."""
    import numpy as np

    layers = sorted(set(table["layer"].to_list()))
    grid = np.full((len(layers), max(table["head"].to_list()) + 1), np.nan)
    for row in table.iter_rows(named=True):
        grid[layers.index(row["layer"]), row["head"]] = row[stat]
    return layers, grid


CURVE_POINTS = 256
"""Points per layer of the norm-by-position panel: longer sequences are averaged in equal bins,
so 4096 positions x 16 layers stay readable."""


def _binned_positions(tokens: Any, column: str) -> tuple[Any, int]:
    """``tokens`` (``layer``, ``position``, ``column``) averaged in bins of ``width`` consecutive
    positions, at most `CURVE_POINTS` per layer; ``(table, width)`` (width 1: unchanged)."""
    import polars as pl

    span = int(tokens["position"].max()) + 1 if tokens.height else 0
    width = max(1, -(-span // CURVE_POINTS))
    if width == 1:
        return tokens, 1
    binned = (
        tokens.with_columns((pl.col("position") // width).alias("bin"))
        .group_by("layer", "bin")
        .agg(pl.col("position").mean(), pl.col(column).mean())
        .sort("layer", "bin")
    )
    return binned, width


def _attention_stat_plot(args: argparse.Namespace) -> int:
    """``plot --stat sink_mass`` (or another `--stats attention` column): a layers x query heads
    heatmap from the file's saved queries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .head_importance import attention_stats

    table = attention_stats(args.file, args.snapshot, storage_options=_storage_options(args))
    layers, grid = _layer_head_grid(table, args.stat)
    heads = grid.shape[1]
    figure, axis = plt.subplots(figsize=(1.2 + 0.45 * heads, 1.5 + 0.22 * len(layers)))
    image = axis.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    axis.set_xlabel("query head")
    axis.set_xticks(range(heads))
    axis.set_ylabel("layer")
    step = max(1, len(layers) // 16)
    axis.set_yticks(range(0, len(layers), step), [str(layer) for layer in layers[::step]])
    axis.set_title(f"{os.path.basename(args.file)}: {args.stat} per layer and query head", fontsize=9)
    figure.colorbar(image, ax=axis, label=args.stat)
    figure.tight_layout()
    _save_figure(figure, args.output, args)
    plt.close(figure)
    print(f"wrote {args.output}: {len(layers)} layers x {heads} query heads of {args.stat}")
    return 0


def _similarity(args: argparse.Namespace) -> int:
    import polars as pl

    from .similarity import head_similarity

    table = head_similarity(args.files, args.snapshot, args.keys, args.jobs, _storage_options(args))
    if args.output:
        _save_parquet(table, args.output, args)
    if table.is_empty():
        print("no head pairs")
        return 0
    for kind, title in (
        ("head", "most similar heads within a layer"),
        ("layer", "most similar across layers"),
    ):
        part = table.filter((pl.col("kind") == kind) & (pl.col("tensor") == args.tensor))
        print(f"{title} ({args.tensor.upper()}, linear CKA):")
        several = table["file"].n_unique() > 1
        for row in part.sort("cka", descending=True, nulls_last=True).head(args.top).iter_rows(named=True):
            where = f"{row['file']}: " if several else ""
            print(
                f"  {where}layer {row['layer']} head {row['head']} ~ layer {row['other_layer']} head "
                f"{row['other_head']}: CKA {row['cka']:.3f}, mean cosine {row['cosine_mean']:.3f}"
            )
    return 0


def _merged(args: argparse.Namespace) -> int:
    result = _batch(args, merge=True)
    table = result.table
    if args.output and not table.is_empty():
        _save_parquet(table, args.output, args)
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


def _stats(args: argparse.Namespace) -> int:
    import polars as pl

    from .stats import outliers

    if args.stats == frozenset({"attention"}):
        return _attention_stats(args)
    if args.merge:
        return _merged(args)
    table = _table(args)
    if args.output:
        _save_parquet(table, args.output, args)
    if "norm_mean" not in table.columns:  # --stats without norms: medians of what was computed
        _medians(table)
        return 1 if args.failed else 0
    flagged = outliers(table, args.factor)
    for name in flagged["file"].unique(maintain_order=True).to_list():
        rows = flagged.filter(pl.col("file") == name)
        counts = rows.filter(pl.col("tensor") == "k")["n_tokens"].to_list()
        low, high = min(counts), max(counts)
        held = f"{high} tokens" if low == high else f"{high} tokens; uneven: heads hold {low} to {high}"
        print(f"{name}: mean ||K|| per layer and KV head ({held}; * = above {args.factor}x the median head)")
        layers = sorted(set(rows["layer"].to_list()))
        for layer in layers:
            cells = []
            for row in rows.filter((pl.col("layer") == layer) & (pl.col("seq") == 0)).iter_rows(named=True):
                mark = "*" if row["outlier"] else " "
                cells.append(f"h{row['head']}={row['norm_mean']:7.2f}{mark}")
            print(f"  layer {layer:3d}: " + "  ".join(cells))
        top = rows.sort("ratio_to_median", descending=True).head(3)
        print(
            "  largest: "
            + ", ".join(
                f"layer {r['layer']} head {r['head']} ({r['ratio_to_median']:.2f}x median)"
                for r in top.iter_rows(named=True)
            )
        )
    return 1 if args.failed else 0


def _attention_stats(args: argparse.Namespace) -> int:
    """``stats --stats attention``: per (layer, query head) scores from saved queries."""
    import polars as pl

    from .head_importance import attention_stats

    table = attention_stats(
        args.files,
        args.snapshot,
        window=args.window,
        needle=args.needle,
        storage_options=_storage_options(args),
    )
    if args.output:
        _save_parquet(table, args.output, args)
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


def _simulate(args: argparse.Namespace) -> int:
    """``simulate``: attention-output error per (method, budget, layer, head) under compression."""
    from .compression import METHODS, simulate

    table = simulate(
        args.file,
        args.method or METHODS,
        args.budget,
        args.snapshot,
        window=args.window,
        seed=args.seed,
        storage_options=_storage_options(args),
    )
    _save_parquet(table, args.output, args)
    import polars as pl

    means = (
        table.group_by(["method", "budget"], maintain_order=True)
        .agg(pl.col("relative_error").mean().alias("error"), pl.col("top1_agreement").mean().alias("top1"))
        .sort(["method", "budget"])
    )
    print("mean over heads: method, budget -> relative error of the attention output, top-1 agreement")
    for row in means.iter_rows(named=True):
        print(f"  {row['method']:>9} {row['budget']:5.3f} -> {row['error']:.4f}  {row['top1']:.3f}")
    if args.plot:
        _simulate_plot(means, args)
        print(f"wrote {args.plot}")
    return 0


def _simulate_plot(means: Any, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for method in means["method"].unique(maintain_order=True).to_list():
        rows = means.filter(means["method"] == method).sort("budget")
        axis.plot(rows["budget"].to_list(), rows["error"].to_list(), marker="o", label=method)
    axis.set_xlabel("budget (fraction of prompt keys kept; bits/16 for quantization)")
    axis.set_ylabel("relative error of the attention output")
    axis.set_yscale("log")
    axis.set_title(f"{args.file}: KV compression what-ifs (mean over heads)", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    _save_figure(figure, args.plot, args)
    plt.close(figure)


def _method(text: str) -> str:
    """argparse type: a `simulate` method."""
    from .compression import METHODS

    if text not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {text!r}: one of {', '.join(METHODS)}")
    return text


def _budget(text: str) -> float:
    """argparse type: a budget in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"budget {text} is not in (0, 1]")
    return value


def _force_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="replace existing output files (never an input)")


def _keys_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keys",
        choices=["post_rope", "pre_rope"],
        default="post_rope",
        help="pre_rope: un-rotate K with the RoPE the snapshot records",
    )


def _common(p: argparse.ArgumentParser, many: bool = True, engines: bool = True) -> None:
    if many:
        p.add_argument("files", nargs="+")
    p.add_argument(
        "--snapshot",
        type=int,
        default=-1,
        help="which snapshot of a series: 0, 1, ..., or -1 for the last (default)",
    )
    _keys_option(p)
    p.add_argument(
        "--jobs",
        type=positive_int,
        help="cores to use (default: all): files in processes, the cores left as each file's workers",
    )
    p.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec option for URLs (e.g. endpoint_url=http://host:9000); repeatable",
    )
    if many and engines:
        p.add_argument(
            "--engine",
            choices=["local", "ray"],
            default="local",
            help="local: --jobs processes; ray: a Ray cluster (--address) or local Ray with --jobs CPUs",
        )
        p.add_argument("--address", help="Ray cluster address for --engine ray")
        p.add_argument("--fail-fast", action="store_true", help="stop at the first file that fails")


def _stats_option(p: argparse.ArgumentParser, default: str | None = None) -> None:
    from .stats import BACKENDS, GROUPS

    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="cpu",
        help="cpu: the compiled kernel on --jobs cores; mlx: mlx's device (Metal or CUDA GPU, else CPU), "
        "driven by 3/4 of --jobs worker processes for a local file on Linux (each with its own mlx; "
        "one file under 12 GiB without --jobs: one process, which starts faster)",
    )
    p.add_argument(
        "--stats",
        type=stat_groups_type,
        default=None if default is None else stat_groups_type(default),
        metavar="GROUPS",
        help=f"statistic groups to compute, comma-separated: all (default), {', '.join(GROUPS)}; "
        "or attention (per query head, from saved queries). quant*_error and rank*_error are fractions "
        "of squared error (energy lost); their square root is a relative error like diff's rel_error",
    )


def _export(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .export import export_heads

    written = 0
    paths = export_heads(
        args.file,
        args.output,
        layers=args.layer,
        heads=args.head,
        fmt=args.format,
        keys=args.keys,
        snapshot=args.snapshot,
        storage_options=_storage_options(args),
        force=args.force,
    )
    for _ in tqdm(paths, unit="head", file=sys.stderr, disable=None, leave=False):
        written += 1
    print(f"wrote {written} {args.format} file(s) into {args.output} (one per layer and head)")
    return 0


def _diff(args: argparse.Namespace) -> int:
    """Head-by-head comparison of two captures: summary (worst heads first), Parquet, heatmap."""
    import numpy as np
    import polars as pl

    from .diff import LayoutMismatchError, head_diff

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            table = head_diff(
                args.a,
                args.b,
                snapshot_a=args.snapshot_a,
                snapshot_b=args.snapshot_b,
                keys=args.keys,
                tolerance=args.tolerance,
                storage_options=_storage_options(args),
            )
    except LayoutMismatchError as exc:
        print(f"kvsnap: error: {exc}", file=sys.stderr)
        return 2
    for warning in caught:
        print(f"kvsnap: warning: {warning.message}", file=sys.stderr)
    if args.output:
        _save_parquet(table, args.output, args)
    compared = table.filter(pl.col("n_positions") > 0)
    if compared.is_empty():
        print("the two files hold no position in common")
        return 0
    for tensor in ("k", "v"):
        part = compared.filter(pl.col("tensor") == tensor)
        errors, cosines = part["rel_error"].to_numpy(), part["cosine_mean"].to_numpy()
        diverging = int(part["first_divergent_position"].is_not_null().sum())
        print(
            f"{tensor.upper()}: rel_error median {float(np.median(errors)):.3g}, max "
            f"{float(errors.max()):.3g}; cosine_mean min {float(cosines.min()):.6f}; "
            f"{diverging} of {part.height} heads diverge beyond {args.tolerance:g}"
        )
    positions = int(compared["n_positions"].to_numpy().max())
    print(f"worst heads by rel_error ({positions} positions compared):")
    worst = compared.sort("rel_error", descending=True, nulls_last=True).head(args.top)
    for row in worst.iter_rows(named=True):
        first = row["first_divergent_position"]
        print(
            f"  layer {row['layer']:3d} head {row['head']:2d} seq {row['seq']} {row['tensor']}: "
            f"rel_error {row['rel_error']:.4g}, max_abs_error {row['max_abs_error']:.4g}, "
            f"cosine_mean {row['cosine_mean']:.6f}, norm_ratio {row['norm_ratio']:.4f}, "
            f"first divergent position {first if first is not None else '-'}"
        )
    if args.plot:
        _diff_heatmap(compared, args)
        print(f"wrote {args.plot}")
    return 0


def _diff_heatmap(table: Any, args: argparse.Namespace) -> None:
    """Layers x heads heatmaps of rel_error, K and V side by side, on one colour scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import polars as pl

    rows = table.filter(pl.col("seq") == 0)
    layers = sorted(set(rows["layer"].to_list()))
    heads = max(rows["head"].to_list()) + 1
    grids = {}
    for tensor in ("k", "v"):
        grid = np.full((len(layers), heads), np.nan)
        for row in rows.filter(pl.col("tensor") == tensor).iter_rows(named=True):
            grid[layers.index(row["layer"]), row["head"]] = row["rel_error"]
        grids[tensor] = grid
    top = np.nanmax([np.nanmax(g) for g in grids.values()])
    if not np.isfinite(top) or top <= 0:
        top = 1.0  # identical captures: one empty scale for K and V alike
    figure, axes = plt.subplots(1, 2, figsize=(10, max(4, len(layers) * 0.18 + 1.5)), sharey=True)
    for axis, (tensor, grid) in zip(axes, grids.items(), strict=True):
        image = axis.imshow(grid, aspect="auto", cmap="magma", vmin=0, vmax=top, interpolation="nearest")
        axis.set_title(f"{tensor.upper()}: ||B - A|| / ||A||")
        axis.set_xlabel("KV head")
        axis.set_xticks(range(heads))
    axes[0].set_ylabel("layer")
    axes[0].set_yticks(range(len(layers)), [str(layer) for layer in layers])
    figure.colorbar(image, ax=list(axes), label="relative error (Frobenius)")
    import kvformat

    options = _storage_options(args)
    with (
        kvformat.open(args.a, args.snapshot_a, storage_options=options) as a,
        kvformat.open(args.b, args.snapshot_b, storage_options=options) as b,
    ):
        which = (
            f"snapshot {a.index} of 0..{a.num_snapshots - 1}",
            f"snapshot {b.index} of 0..{b.num_snapshots - 1}",
        )
    positions = int(table["n_positions"].max())
    figure.suptitle(
        f"A = {os.path.basename(args.a)} ({which[0]}), B = {os.path.basename(args.b)} ({which[1]}); "
        f"up to {positions} positions compared per head ({args.keys} keys)",
        fontsize=10,
    )
    _save_figure(figure, args.plot, args)


def _span(text: str) -> tuple[int, int]:
    """argparse type: ``A:B`` absolute positions ``A <= p < B`` (either side may be left out)."""
    low, sep, high = text.partition(":")
    try:
        span = (int(low) if low else 0, int(high) if high else 2**53)
    except ValueError:
        span = (0, -1)
    if not sep or span[0] < 0 or span[1] <= span[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: give positions as A:B with 0 <= A < B")
    return span


def _layer_head(text: str) -> tuple[int, int]:
    """argparse type: ``L:H`` (a layer and a query head)."""
    layer, sep, head = text.partition(":")
    if not sep or not layer.isdigit() or not head.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a layer and a query head as L:H, e.g. 3:1")
    return int(layer), int(head)


def _attention(args: argparse.Namespace) -> int:
    """One query head's attention weights, recomputed from the file, to .npz or Parquet."""
    import numpy as np

    import kvformat

    with kvformat.open(args.file, args.snapshot, storage_options=_storage_options(args)) as snap:
        found = snap.attention(args.layer, args.head, queries=args.queries, keys=args.keys, seq=args.seq)
    suffix = os.path.splitext(args.output)[1].lower()
    with output_path(args.output, inputs=_inputs(args), force=args.force) as temporary:
        if suffix == ".parquet":
            import polars as pl

            rows, columns = np.nonzero(found.weights)
            pl.DataFrame(
                {
                    "query_position": found.query_positions[rows],
                    "key_position": found.key_positions[columns],
                    "weight": found.weights[rows, columns],
                }
            ).write_parquet(temporary)
        else:
            with open(temporary, "xb") as f:
                np.savez(
                    f,
                    weights=found.weights,
                    query_positions=found.query_positions,
                    key_positions=found.key_positions,
                )
    form = "non-zero weights, long form" if suffix == ".parquet" else "float32"
    count, keys = found.weights.shape
    where = f"layer {args.layer} query head {args.head}"
    print(f"wrote {args.output}: {where}, {count} queries x {keys} keys ({form})")
    return 0


def _attention_map(args: argparse.Namespace) -> int:
    """`plot --attention L:H`: one query head's attention map, log colour scale, labelled axes,
    the prompt|generated boundary marked, token labels on request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm

    import kvformat

    from .tokens import token_pieces

    layer, head = args.attention
    with kvformat.open(args.file, args.snapshot, storage_options=_storage_options(args)) as snap:
        found = snap.attention(layer, head)
        generated = snap.snapshot_metadata.get("generated")
        seq_len = snap.seq_len
        pieces = token_pieces(snap)
        model = snap.metadata.get("model", {})
        spec = snap.layers[layer].queries
    weights = np.where(found.weights > 0, found.weights, np.nan)
    figure, axis = plt.subplots(figsize=(11, max(3.5, min(9, 0.08 * weights.shape[0] + 2.5))))
    floor = max(float(np.nanmin(weights)) if np.isfinite(weights).any() else 1e-6, 1e-6)
    image = axis.imshow(
        weights, aspect="auto", cmap="magma", norm=LogNorm(vmin=floor, vmax=1.0), interpolation="nearest",
        extent=(found.key_positions[0] - 0.5, found.key_positions[-1] + 0.5,
                found.query_positions[-1] + 0.5, found.query_positions[0] - 0.5),
    )  # fmt: skip
    figure.colorbar(image, ax=axis, label="attention weight (log scale; masked keys blank)")
    axis.set_xlabel("key position")
    axis.set_ylabel("query position")
    name = model.get("name") if isinstance(model, dict) else None
    window = f", window {spec.window}" if spec is not None and spec.window else ""
    axis.set_title(
        f"{os.path.basename(args.file)} | {name or 'model not recorded'} | layer {layer} query head {head} "
        f"(KV head {spec.kv_heads[head] if spec else '?'}{window}) | snapshot {snap.index}",
        fontsize=10,
    )
    if isinstance(generated, int) and 0 < generated <= seq_len:
        boundary = seq_len - generated - 0.5
        axis.axvline(boundary, color="cyan", ls="--", lw=1)
        axis.axhline(boundary, color="cyan", ls="--", lw=1)
        axis.annotate("prompt | generated", (boundary, 0), xycoords=("data", "axes fraction"),
                      color="cyan", ha="center", va="bottom", fontsize=8)  # fmt: skip
    if args.token_labels and pieces is not None:
        labels = pieces[0]
        keys = found.key_positions
        every = max(1, keys.size // 60)
        shown = keys[::every]
        axis.set_xticks(shown, [repr(labels[p])[1:-1][:10] if p < len(labels) else "" for p in shown],
                        rotation=90, fontsize=6)  # fmt: skip
        queries = found.query_positions[:: max(1, found.query_positions.size // 40)]
        axis.set_yticks(queries, [repr(labels[p])[1:-1][:10] if p < len(labels) else "" for p in queries],
                        fontsize=6)  # fmt: skip
    figure.tight_layout()
    _save_figure(figure, args.output, args)
    plt.close(figure)
    print(
        f"wrote {args.output}: layer {layer} query head {head}, {weights.shape[0]} x {weights.shape[1]} map"
    )
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "stats",
        help="per-head statistics (norms, channels, spectrum, ...); prints mean ||K||, outliers flagged",
    )
    _common(p)
    p.add_argument("--factor", type=positive_float, default=1.5, help="outlier threshold vs the median head")
    p.add_argument("-o", "--output", help="write the full statistics table as Parquet")
    p.add_argument(
        "--merge",
        action="store_true",
        help="one row per (layer, head, tensor) over all files (they must share the model's layout)",
    )
    _stats_option(p)
    p.add_argument(
        "--window",
        type=positive_int,
        default=256,
        help="--stats attention: the recent positions streaming_error keeps beside 4 sinks (default 256)",
    )
    p.add_argument(
        "--needle",
        type=_span,
        metavar="A:B",
        help="--stats attention: retrieval_score only for tokens copied from positions A..B-1",
    )
    _force_option(p)
    p.set_defaults(func=_stats, check=_check_outputs)

    p = sub.add_parser(
        "simulate",
        help="attention-output error per head if the cache had been compressed (needs --queries)",
    )
    p.add_argument("file")
    p.add_argument("--snapshot", type=int, default=-1, help="which snapshot of a series (default: the last)")
    p.add_argument(
        "--method",
        type=_method,
        nargs="+",
        default=None,
        help="streaming, snapkv, h2o, random, kivi2, kivi4, token2, token4 (default: all)",
    )
    p.add_argument(
        "--budget",
        type=_budget,
        nargs="+",
        default=[0.1, 0.25, 0.5],
        help="fractions of the prompt's keys kept (default 0.1 0.25 0.5)",
    )
    p.add_argument("--window", type=positive_int, default=32, help="SnapKV's observation window, queries")
    p.add_argument("--seed", type=int, default=0, help="the random method's sample")
    p.add_argument(
        "-o", "--output", required=True, help="Parquet table, one row per (method, budget, layer, head)"
    )
    p.add_argument("--plot", help="PNG: error against budget per method")
    p.add_argument(
        "--storage-option", action="append", metavar="KEY=VALUE", help="for a URL: fsspec option; repeatable"
    )
    _force_option(p)
    p.set_defaults(func=_simulate, check=_check_outputs)

    p = sub.add_parser("outliers", help="heads whose statistic exceeds N x the median head")
    _common(p)
    p.add_argument(
        "--stat", default="norm_mean", help="a one-number column of 'kvsnap stats' (default norm_mean)"
    )
    p.add_argument("--tensor", choices=["k", "v"], default="k")
    p.add_argument("--threshold", type=positive_float, default=1.5, help="ratio to the file's median head")
    _stats_option(p)
    p.set_defaults(func=_outliers, check=_check_outputs)

    p = sub.add_parser(
        "attention",
        help="one query head's attention weights recomputed from saved queries (.npz or .parquet)",
    )
    p.add_argument("file")
    p.add_argument("--layer", type=non_negative_int, required=True)
    p.add_argument("--head", type=non_negative_int, required=True, help="query head")
    p.add_argument("--queries", type=_span, metavar="A:B", help="query positions A <= p < B (default: all)")
    p.add_argument("--keys", type=_span, metavar="A:B", help="only these key columns (weights over all keys)")
    p.add_argument("--seq", type=non_negative_int, default=0)
    p.add_argument("--snapshot", type=int, default=-1, help="which snapshot of a series (default: last)")
    p.add_argument(
        "-o", "--output", required=True, help="FILE.npz (the map) or FILE.parquet (non-zero weights)"
    )
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec option for URLs")
    _force_option(p)
    p.set_defaults(func=_attention, check=_check_outputs)

    p = sub.add_parser("plot", help="PNG: layers x heads heatmap of a statistic, norm by position")
    p.add_argument("file")
    _common(p, many=False)
    p.add_argument(
        "--attention",
        type=_layer_head,
        metavar="L:H",
        help="instead: the attention map of layer L, query head H (needs a capture with --queries)",
    )
    p.add_argument(
        "--stat",
        default="norm_mean",
        help="heatmap statistic: a one-number column of 'kvsnap stats' (default norm_mean), or of "
        "'--stats attention' (sink_mass, retrieval_score, ...: per query head, needs saved queries)",
    )
    p.add_argument("--tensor", choices=["k", "v"], default="k", help="K or V (default k)")
    p.add_argument("-o", "--output", required=True, help="PNG file (written under exactly this name)")
    p.add_argument(
        "--token-labels",
        action="store_true",
        help="label positions with their tokens (if the file records them)",
    )
    _stats_option(p)
    _force_option(p)
    p.set_defaults(func=_plot, check=_check_outputs)

    p = sub.add_parser(
        "export", help="one file per layer and head (L00-H00.csv, as go-mlx probes), streamed head by head"
    )
    p.add_argument("file")
    p.add_argument("-o", "--output", required=True, help="a new folder (created; refused if it exists)")
    p.add_argument("--layer", type=non_negative_int, action="append", help="only this layer (repeatable)")
    p.add_argument("--head", type=non_negative_int, action="append", help="only this head (repeatable)")
    p.add_argument("--format", choices=["csv", "npy", "npz", "parquet"], default="csv")
    p.add_argument("--snapshot", type=int, default=-1)
    _keys_option(p)
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec option for URLs")
    _force_option(p)
    p.set_defaults(func=_export, check=_check_outputs)

    p = sub.add_parser("diff", help="compare two captures head by head at the positions both hold")
    p.add_argument("a", help="reference capture (A)")
    p.add_argument("b", help="capture compared with it (B)")
    p.add_argument("-o", "--output", help="write every (layer, head, seq, tensor) row as Parquet")
    p.add_argument("--plot", help="PNG: layers x heads heatmap of rel_error, K and V")
    p.add_argument("--snapshot-a", type=int, default=-1, help="snapshot of A (default: last)")
    p.add_argument("--snapshot-b", type=int, default=-1, help="snapshot of B (default: last)")
    p.add_argument(
        "--tolerance",
        type=positive_float,
        default=1e-3,
        help="row relative error ||B_t - A_t|| / ||A_t|| that counts as divergent (default 1e-3)",
    )
    p.add_argument("--top", type=positive_int, default=10, help="worst heads to print (default 10)")
    _keys_option(p)
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec option for URLs")
    _force_option(p)
    p.set_defaults(func=_diff, check=_check_outputs)

    p = sub.add_parser("similarity", help="cross-head and cross-layer linear CKA and cosine")
    _common(p, engines=False)
    p.add_argument("--tensor", choices=["k", "v"], default="k")
    p.add_argument("--top", type=positive_int, default=5, help="pairs to print per kind")
    p.add_argument("-o", "--output", help="write every pair as Parquet")
    _force_option(p)
    p.set_defaults(func=_similarity, check=_check_outputs)
