"""`kvsnap diff` (two captures head by head) and `kvsnap similarity` (linear CKA across heads and layers)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

import kvformat

from ..dependencies import matplotlib, plt
from ..tools.diff import LayoutMismatchError, head_diff
from ..tools.similarity import head_similarity
from .common import FromArgs, save_figure, save_table, url_options, warnings_printed


@dataclass(frozen=True)
class SimilarityOptions(FromArgs):
    """``kvsnap similarity``'s options, typed (`from_args`)."""

    files: list[str] = field(default_factory=list)
    snapshot: int = -1
    keys: str = "post_rope"
    jobs: int | None = None
    tensor: str = "k"
    top: int = 5
    output: str | None = None


@dataclass(frozen=True)
class DiffOptions(FromArgs):
    """``kvsnap diff``'s options, typed (`from_args`)."""

    a: str = ""
    b: str = ""
    output: str | None = None
    plot: str | None = None
    snapshot_a: int = -1
    snapshot_b: int = -1
    tolerance: float = 1e-3
    top: int = 10
    keys: str = "post_rope"
    all_positions: bool = False


def similarity_command(args: argparse.Namespace) -> int:
    options = SimilarityOptions.from_args(args)

    table = head_similarity(options.files, options.snapshot, options.keys, options.jobs, url_options(args))
    if options.output:
        save_table(table, options.output, args)
    if table.is_empty():
        print("no head pairs")
        return 0
    for kind, title in (
        ("head", "most similar heads within a layer"),
        ("layer", "most similar across layers"),
    ):
        part = table.filter((pl.col("kind") == kind) & (pl.col("tensor") == options.tensor))
        print(f"{title} ({options.tensor.upper()}, linear CKA):")
        several = table["file"].n_unique() > 1
        for row in part.sort("cka", descending=True, nulls_last=True).head(options.top).iter_rows(named=True):
            where = f"{row['file']}: " if several else ""
            print(
                f"  {where}layer {row['layer']} head {row['head']} ~ layer {row['other_layer']} head "
                f"{row['other_head']}: CKA {row['cka']:.3f}, mean cosine {row['cosine_mean']:.3f}"
            )
    return 0


def diff_command(args: argparse.Namespace) -> int:
    """Head-by-head comparison of two captures: summary (worst heads first), Parquet, heatmap."""
    options = DiffOptions.from_args(args)

    try:
        with warnings_printed():
            table = head_diff(
                options.a,
                options.b,
                snapshot_a=options.snapshot_a,
                snapshot_b=options.snapshot_b,
                keys=options.keys,
                tolerance=options.tolerance,
                storage_options=url_options(args),
                all_positions=options.all_positions,
            )
    except LayoutMismatchError as exc:
        print(f"kvsnap: error: {exc}", file=sys.stderr)
        return 2
    if options.output:
        save_table(table, options.output, args)
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
            f"{diverging} of {part.height} heads diverge beyond {options.tolerance:g}"
        )
    positions = int(compared["n_positions"].to_numpy().max())
    print(f"worst heads by rel_error ({positions} positions compared{_divergence_note(table)}):")
    worst = compared.sort("rel_error", descending=True, nulls_last=True).head(options.top)
    for row in worst.iter_rows(named=True):
        first = row["first_divergent_position"]
        print(
            f"  layer {row['layer']:3d} head {row['head']:2d} seq {row['seq']} {row['tensor']}: "
            f"rel_error {row['rel_error']:.4g}, max_abs_error {row['max_abs_error']:.4g}, "
            f"cosine_mean {row['cosine_mean']:.6f}, norm_ratio {row['norm_ratio']:.4f}, "
            f"first divergent position {first if first is not None else '-'}"
        )
    if options.plot:
        _diff_heatmap(compared, options, args)
        print(f"wrote {options.plot}")
    return 0


def _divergence_note(table: Any) -> str:
    """``"; token ids diverge at position 78: 40 later positions left out"`` (or how they were
    compared anyway), "" when the token ids agree or are not recorded."""
    diverging = table.filter(pl.col("tokens_diverge_at").is_not_null())
    if diverging.is_empty():
        return ""
    at = int(diverging["tokens_diverge_at"].min())
    left_out = int(table["positions_left_out"].max())
    if left_out:
        return f"; token ids diverge at position {at}: up to {left_out} later positions per head left out"
    return f"; token ids diverge at position {at}: later positions compared too (--all-positions)"


def _diff_heatmap(table: Any, options: DiffOptions, args: argparse.Namespace) -> None:
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

    storage = url_options(args)
    with (
        kvformat.open(options.a, options.snapshot_a, storage_options=storage) as a,
        kvformat.open(options.b, options.snapshot_b, storage_options=storage) as b,
    ):
        which = (
            f"snapshot {a.index} of 0..{a.num_snapshots - 1}",
            f"snapshot {b.index} of 0..{b.num_snapshots - 1}",
        )
    positions = int(table["n_positions"].max())
    figure.suptitle(
        f"A = {os.path.basename(options.a)} ({which[0]}), B = {os.path.basename(options.b)} ({which[1]}); "
        f"up to {positions} positions compared per head ({options.keys} keys){_divergence_note(table)}",
        fontsize=10,
    )
    assert options.plot is not None  # (drawn for --plot only)
    save_figure(figure, options.plot, args)
