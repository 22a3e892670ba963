"""`kvsnap diff` (two captures head by head) and `kvsnap similarity` (linear CKA across heads and layers)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np
import polars as pl

import kvformat

from ..dependencies import matplotlib, plt
from ..tools.diff import LayoutMismatchError, head_diff
from ..tools.similarity import head_similarity
from .common import save_figure, save_parquet, url_options, warnings_printed


def similarity_command(args: argparse.Namespace) -> int:

    table = head_similarity(args.files, args.snapshot, args.keys, args.jobs, url_options(args))
    if args.output:
        save_parquet(table, args.output, args)
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


def diff_command(args: argparse.Namespace) -> int:
    """Head-by-head comparison of two captures: summary (worst heads first), Parquet, heatmap."""

    try:
        with warnings_printed():
            table = head_diff(
                args.a,
                args.b,
                snapshot_a=args.snapshot_a,
                snapshot_b=args.snapshot_b,
                keys=args.keys,
                tolerance=args.tolerance,
                storage_options=url_options(args),
            )
    except LayoutMismatchError as exc:
        print(f"kvsnap: error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        save_parquet(table, args.output, args)
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

    matplotlib.use("Agg")

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

    options = url_options(args)
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
    save_figure(figure, args.plot, args)
