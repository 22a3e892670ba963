"""`kvsnap plot`: a statistic's layers x heads heatmap beside norm-by-position curves, or an attention map."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

import kvformat
from kvformat.attention import refuse_pooled
from kvsnap.errors import CommandError, OptionsConflictError

from ..attention.compression import Options, kept_mask
from ..attention.head_importance import attention_stats
from ..attention.names import SCALARS
from ..attention.tokens import token_pieces
from ..dependencies import matplotlib, mcolors, plt
from ..tools.token_table import token_table
from .common import FromArgs, save_figure, url_options
from .statistics import BatchRequest, statistics_table


@dataclass(frozen=True)
class PlotOptions(FromArgs):
    """``kvsnap plot``'s options, typed (`from_args`)."""

    file: str = ""
    snapshot: int = -1
    attention: tuple[int, int] | None = None
    stat: str | None = None
    tensor: str = "k"
    scale: str = "log"
    output: str = ""
    token_labels: bool = False
    kept: tuple[str, float] | None = None
    window: int | None = None

    @property
    def statistic(self) -> str:
        """The heatmap's statistic (``norm_mean`` unless ``--stat`` names another)."""
        return self.stat or "norm_mean"


def plot_command(args: argparse.Namespace) -> int:
    """A layers x heads heatmap of one statistic and per-position norm curves, as one PNG: a title
    naming file, model, snapshot and statistic; labelled colour scales; the prompt/generation
    boundary; token labels on request. ``--attention`` and per-query-head statistics go to their
    own figures."""
    options = PlotOptions.from_args(args)
    _check_combination(options)
    if options.attention is not None:
        return _attention_map(options, args)
    if options.statistic in SCALARS:
        return _attention_stat_plot(options, args)
    return _statistic_plot(options, args)


def _check_combination(options: PlotOptions) -> None:
    """`OptionsConflictError` for options that belong to another kind of figure."""
    if options.window is not None and (options.kept is None or options.kept[0] != "snapkv"):
        raise OptionsConflictError("--window sets SnapKV's observation window: give it with --kept snapkv:B")
    if options.attention is not None and options.stat is not None:
        raise OptionsConflictError("--stat picks a heatmap's statistic: leave it out with --attention")
    if options.attention is None and options.kept is not None:
        raise OptionsConflictError("--kept shades an attention map: give it with --attention L:H")


def _statistic_plot(options: PlotOptions, args: argparse.Namespace) -> int:
    """The heatmap of one statistic per layer and KV head beside the per-position norm curves."""
    matplotlib.use("Agg")

    layers, grid = _statistic_grid(options, args)
    with kvformat.open(options.file, options.snapshot, storage_options=url_options(args)) as snap:
        index, count, seq_len = snap.index, snap.num_snapshots, snap.seq_len
        generated = snap.snapshot_metadata.get("generated")
        model = snap.metadata.get("model", {})
    model_name = model.get("name") if isinstance(model, dict) else None
    name = f"{options.tensor.upper()} {options.statistic}"
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    figure.suptitle(
        f"{os.path.basename(options.file)}  |  model {model_name or '(not recorded)'}  |  "
        f"snapshot {index} (of 0..{count - 1})  |  {name}",
        fontsize=11,
    )
    _heatmap(figure, left, grid, layers, name, "KV head")
    left.set_title(f"{name} per layer and head")
    points = _norm_curves(figure, right, layers, options, args)
    if isinstance(generated, int) and 0 < generated <= seq_len:
        _mark_boundary(right, seq_len - generated)
    figure.tight_layout()
    save_figure(figure, options.output, args)
    plt.close(figure)
    print(f"wrote {options.output}: {len(layers)} layers x {grid.shape[1]} heads, {points} position points")
    return 0


def _statistic_grid(options: PlotOptions, args: argparse.Namespace) -> tuple[list[int], Any]:
    """The file's layers and ``--stat`` of ``--tensor`` as a ``(layers, heads)`` grid (sequence 0)."""

    request = dataclasses.replace(BatchRequest.from_args(args), files=[options.file])
    table = statistics_table(request)[0].filter((pl.col("tensor") == options.tensor) & (pl.col("seq") == 0))
    keys = ("seq", "layer", "head", "snapshot")
    numeric = [c for c, t in table.schema.items() if t.is_numeric() and c not in keys]
    if options.statistic not in numeric:
        raise CommandError(f"unknown statistic {options.statistic!r}; one of: {', '.join(numeric)}")
    return _layer_head_grid(table, options.statistic)


def _heatmap(figure: Any, axis: Any, grid: Any, layers: list[int], name: str, heads: str) -> None:
    """``grid`` ``(layers, heads)`` as an image on ``axis``, rows labelled by layer, with a colour bar."""
    image = axis.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    axis.set_xlabel(heads)
    axis.set_xticks(range(grid.shape[1]))
    axis.set_ylabel("layer")
    step = max(1, len(layers) // 16)
    axis.set_yticks(range(0, len(layers), step), [str(layer) for layer in layers[::step]])
    figure.colorbar(image, ax=axis, label=name)


def _norm_curves(
    figure: Any, axis: Any, layers: list[int], options: PlotOptions, args: argparse.Namespace
) -> int:
    """Mean norm over heads by position, one line per layer (binned past `CURVE_POINTS`), token
    labels on request; the number of points per line."""
    column = f"{options.tensor}_norm"
    tokens = (
        token_table(options.file, options.snapshot, url_options(args))
        .filter(pl.col("seq") == 0)
        .group_by("layer", "position")
        .agg(pl.col(column).mean(), pl.col("token_text").first())
        .sort("layer", "position")
        .collect()
    )
    curves, width = _binned_positions(tokens, column)
    colors = plt.get_cmap("viridis")
    scale = mcolors.Normalize(min(layers), max(layers)) if layers else mcolors.Normalize(0, 1)
    for layer in layers:
        part = curves.filter(pl.col("layer") == layer)
        axis.plot(part["position"], part[column], color=colors(scale(layer)), lw=0.8)
    figure.colorbar(plt.cm.ScalarMappable(scale, colors), ax=axis, label="layer")
    axis.set_xlabel("position")
    axis.set_ylabel(f"mean ||{options.tensor.upper()}|| over heads")
    binned = f", mean of {width} positions per point" if width > 1 else ""
    axis.set_title(f"||{options.tensor.upper()}|| by position, one line per layer{binned}", pad=14)
    if options.token_labels:
        _token_ticks(axis, tokens.filter(pl.col("layer") == layers[0]) if layers else tokens)
    return int(curves.height)


def _mark_boundary(axis: Any, boundary: int) -> None:
    """A dashed line before position ``boundary``, the first generated token."""
    axis.axvline(boundary - 0.5, color="crimson", ls="--", lw=1)
    axis.annotate(
        "prompt | generated",
        (boundary - 0.5, 1.0),
        xycoords=("data", "axes fraction"),
        ha="center",
        va="bottom",
        color="crimson",
        fontsize=8,
    )


def _token_ticks(axis: Any, tokens: Any) -> None:
    """Label up to 60 positions of ``axis`` with their token text (a note when none is recorded)."""
    pairs = zip(tokens["position"], tokens["token_text"], strict=True)
    labelled = [(p, t) for p, t in pairs if t is not None]
    if not labelled:
        print("note: the file records no token text; plotting without token labels", file=sys.stderr)
        return
    shown = labelled[:: max(1, len(labelled) // 60)]
    axis.set_xticks([p for p, _ in shown], [repr(t)[1:-1][:12] for _, t in shown], rotation=90, fontsize=6)


def _layer_head_grid(table: Any, stat: str) -> tuple[list[int], Any]:
    """The layers of ``table`` and its ``stat`` as a ``(layers, heads)`` array (NaN where absent)."""

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


def _attention_stat_plot(options: PlotOptions, args: argparse.Namespace) -> int:
    """``plot --stat sink_mass`` (or another `--stats attention` column): a layers x query heads
    heatmap from the file's saved queries."""

    matplotlib.use("Agg")

    table = attention_stats(options.file, options.snapshot, storage_options=url_options(args))
    layers, grid = _layer_head_grid(table, options.statistic)
    heads = grid.shape[1]
    figure, axis = plt.subplots(figsize=(1.2 + 0.45 * heads, 1.5 + 0.22 * len(layers)))
    _heatmap(figure, axis, grid, layers, options.statistic, "query head")
    title = f"{os.path.basename(options.file)}: {options.statistic} per layer and query head"
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    save_figure(figure, options.output, args)
    plt.close(figure)
    print(f"wrote {options.output}: {len(layers)} layers x {heads} query heads of {options.statistic}")
    return 0


def _attention_map(options: PlotOptions, args: argparse.Namespace) -> int:
    """`plot --attention L:H`: one query head's attention map, log colour scale, labelled axes,
    the prompt|generated boundary marked, token labels on request."""

    matplotlib.use("Agg")

    assert options.attention is not None  # (drawn for --attention only)
    layer, head = options.attention
    with kvformat.open(options.file, options.snapshot, storage_options=url_options(args)) as snap:
        if 0 <= layer < snap.num_layers:  # a map by key position: pooled groups have none (1.8)
            refuse_pooled(snap.layers[layer].queries, layer)
        found = snap.attention(layer, head)
        evicted = None
        if options.kept is not None:
            evicted = kept_mask(snap, layer, head, *options.kept, options=Options(window=options.window))
        generated = snap.snapshot_metadata.get("generated")
        seq_len = snap.seq_len
        pieces = token_pieces(snap)
        model = snap.metadata.get("model", {})
        spec = snap.layers[layer].queries
    dense, extent, step = _map_grid(found.weights, found.key_positions, found.query_positions)
    figure, (axis, margin) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(11, max(4.5, min(10, 0.08 * dense.shape[0] + 3.5))),
        gridspec_kw={"height_ratios": (4, 1)},
    )
    norm, label = _colour_scale(dense, options.scale)
    image = axis.imshow(
        np.where(dense > 0, dense, np.nan), aspect="auto", cmap="magma", norm=norm,
        interpolation="nearest", extent=extent,
    )  # fmt: skip
    shown = f"; each cell the largest of {step[0]} x {step[1]} weights" if step != (1, 1) else ""
    figure.colorbar(image, ax=[axis, margin], label=label + shown)
    _received_strip(margin, found.weights, found.key_positions)
    margin.set_xlabel("key position")
    axis.set_ylabel("query position")
    axis.set_title(_map_title(options.file, model, spec, layer, head, snap.index), fontsize=10)
    _mark_prompt_end(axis, generated, seq_len)
    if evicted is not None:
        assert options.kept is not None  # (evicted is computed for --kept only)
        method, fraction = options.kept
        key_positions, keep = evicted
        _kept_strip(axis, key_positions, keep)
        axis.set_title(
            axis.get_title() + f"\nstrip above: the {int(keep.sum())} of {keep.size} keys {method} keeps at "
            f"budget {fraction:g} (light), evicted (dark)",
            fontsize=10,
            pad=18,
        )
    if options.token_labels and pieces is not None:
        _map_token_ticks(axis, pieces[0], found.key_positions, found.query_positions)
    save_figure(figure, options.output, args)
    plt.close(figure)
    rows, columns = found.weights.shape
    print(f"wrote {options.output}: layer {layer} query head {head}, {rows} x {columns} map")
    return 0


MAP_CELLS = (600, 900)
"""At most this many (query, key) cells are drawn: a larger map is max-pooled to it, so that a
sink column or a single strong weight stays visible whatever the map's size."""


def _map_grid(weights: Any, keys: Any, queries: Any) -> tuple[Any, tuple[float, ...], tuple[int, int]]:
    """The weights ``(n_queries, n_keys)`` on a dense grid of every key position from the first
    to the last held (NaN where the file holds no key, as after a rotating cache dropped some),
    max-pooled to at most `MAP_CELLS`; its extent for ``imshow``, and the pooling steps."""

    low, high = int(keys.min()), int(keys.max())
    dense = np.full((weights.shape[0], high - low + 1), np.nan, np.float32)
    dense[:, keys - low] = weights
    step = (-(-dense.shape[0] // MAP_CELLS[0]), -(-dense.shape[1] // MAP_CELLS[1]))
    if step != (1, 1):
        rows, columns = -(-dense.shape[0] // step[0]), -(-dense.shape[1] // step[1])
        padded = np.full((rows * step[0], columns * step[1]), np.nan, np.float32)
        padded[: dense.shape[0], : dense.shape[1]] = dense
        blocks = padded.reshape(rows, step[0], columns, step[1])
        with np.errstate(all="ignore"):
            filled = np.isfinite(blocks).any(axis=(1, 3))
            dense = np.where(
                filled, np.nanmax(np.where(np.isfinite(blocks), blocks, -1.0), axis=(1, 3)), np.nan
            )
    extent = (low - 0.5, high + 0.5, float(queries[-1]) + 0.5, float(queries[0]) - 0.5)
    return dense, extent, step


def _received_strip(axis: Any, weights: Any, keys: Any) -> None:
    """Below the map, on the same key axis: the mean weight each key receives over the map's
    queries, as a filled step curve (a sink shows as a peak however many keys the map has)."""

    received = weights.astype(np.float64).mean(axis=0) if weights.shape[0] else np.zeros(keys.size)
    low, high = int(keys.min()), int(keys.max())
    dense = np.zeros(high - low + 1)
    dense[keys - low] = received
    # Lines at least 1.5 points wide whatever the map's width: a sink shows even among 8k keys
    axis.vlines(np.arange(low, high + 1), 0, dense, color="tab:purple", linewidth=1.5)
    axis.set_ylim(0, max(float(dense.max()) * 1.05, 1e-6))
    axis.set_ylabel("weight\nreceived", fontsize=8)
    top = int(np.argmax(dense))
    axis.annotate(f"key {low + top}: {dense[top]:.3f}", (low + top, dense[top]), fontsize=7,
                  xytext=(4, -10), textcoords="offset points", color="tab:purple")  # fmt: skip


def _mark_prompt_end(axis: Any, generated: Any, seq_len: int) -> None:
    """Dashed lines between the prompt's positions and the generated ones, where recorded."""
    if not (isinstance(generated, int) and 0 < generated <= seq_len):
        return
    boundary = seq_len - generated - 0.5
    axis.axvline(boundary, color="cyan", ls="--", lw=1)
    axis.axhline(boundary, color="cyan", ls="--", lw=1)
    axis.annotate("prompt | generated", (boundary, 0), xycoords=("data", "axes fraction"),
                  color="cyan", ha="center", va="bottom", fontsize=8)  # fmt: skip


def _kept_strip(axis: Any, positions: Any, keep: Any) -> None:
    """A strip above the map over the same key axis: kept keys light, evicted keys dark (the map
    itself stays unshaded, readable at any budget)."""

    low, high = int(positions.min()), int(positions.max())
    row = np.full(high - low + 1, np.nan)
    row[positions - low] = keep.astype(float)
    strip = axis.inset_axes((0.0, 1.01, 1.0, 0.035), sharex=axis)
    strip.imshow(row[None, :], aspect="auto", cmap="Greys_r", vmin=-0.4, vmax=1.0,
                 interpolation="nearest", extent=(low - 0.5, high + 0.5, 0, 1))  # fmt: skip
    strip.set_yticks([])
    strip.tick_params(axis="x", labelbottom=False, bottom=False)


def _map_token_ticks(axis: Any, labels: list[str], keys: Any, queries: Any) -> None:
    """Token text on an attention map's axes: up to 60 key positions, 40 query positions."""

    def text(positions: Any) -> list[str]:
        return [repr(labels[p])[1:-1][:10] if p < len(labels) else "" for p in positions]

    shown = keys[:: max(1, keys.size // 60)]
    axis.set_xticks(shown, text(shown), rotation=90, fontsize=6)
    rows = queries[:: max(1, queries.size // 40)]
    axis.set_yticks(rows, text(rows), fontsize=6)


def _colour_scale(dense: Any, scale: str) -> tuple[Any, str]:
    """The colour normalization of an attention map ``dense`` (``"log"``: from its smallest
    positive weight to 1; ``"linear"``: 0 to its largest) and the colour bar's label."""
    positive = dense[np.isfinite(dense) & (dense > 0)]
    if scale == "log":
        floor = max(float(positive.min()) if positive.size else 1e-6, 1e-6)
        return mcolors.LogNorm(vmin=floor, vmax=1.0), "attention weight (log scale; masked keys blank)"
    norm = mcolors.Normalize(vmin=0.0, vmax=float(positive.max()) if positive.size else 1.0)
    return norm, "attention weight (masked keys blank)"


def _map_title(file: str, model: Any, spec: Any, layer: int, head: int, snapshot: int) -> str:
    """An attention map's title: the file, the model, the query head (its KV head and window)."""
    name = model.get("name") if isinstance(model, dict) else None
    window = f", window {spec.window}" if spec is not None and spec.window else ""
    return (
        f"{os.path.basename(file)} | {name or 'model not recorded'} | layer {layer} query head {head} "
        f"(KV head {spec.kv_heads[head] if spec else '?'}{window}) | snapshot {snapshot}"
    )
