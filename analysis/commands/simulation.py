"""`kvsnap simulate`: attention-output error per head had the cache been compressed, table and plot."""

from __future__ import annotations

import argparse
from typing import Any

from ..attention.compression import CompressionWarning, simulate
from ..dependencies import matplotlib, pl, plt
from .common import save_figure, save_parquet, url_options, warnings_printed


def simulate_command(args: argparse.Namespace) -> int:
    """``simulate``: attention-output error per (method, budget, layer, head) under compression."""

    with warnings_printed(CompressionWarning):
        table = simulate(
            args.file,
            args.method,
            args.budget,
            args.snapshot,
            window=args.window,
            kernel=args.kernel,
            pooling=args.pooling,
            compress=args.compress,
            question_start=args.question_start,
            seed=args.seed,
            storage_options=url_options(args),
        )
    save_parquet(table, args.output, args)

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

    matplotlib.use("Agg")

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
    save_figure(figure, args.plot, args)
    plt.close(figure)
