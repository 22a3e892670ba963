"""Analysis commands: `kvsnap stats`, `outliers`, `simulate`, `attention`, `plot`, `export`, `diff`,
`similarity`. This module only declares them; each command lives in `analysis.commands`. The
capture stage adds ``simulate --model`` (the end-to-end what-if, which runs the model:
`capture.cli.extend_simulate`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from kvsnap.arguments import non_negative_int, odd_int, positive_float, positive_int, remote_options

from .commands.common import FIGURES, TABLES, check_outputs
from .commands.options import (
    budget,
    common_options,
    force_option,
    kept,
    keys_option,
    layer_head,
    method,
    span,
    stats_arguments,
    stats_option,
)

ATTENTION_FORMATS = ("npz", "parquet", "csv")  # the map (npz) or its non-zero weights (long form)

COMMANDS = {
    "stats_command": "statistics",
    "outliers_command": "statistics",
    "simulate_command": "simulation",
    "attention_command": "files",
    "export_command": "files",
    "plot_command": "plots",
    "diff_command": "compare",
    "similarity_command": "compare",
    "view_command": "view",
}
"""Each command's function and the module of `analysis.commands` that holds it: imported when the
command runs, so that building the parser (every ``kvsnap`` command does) imports none of them."""


def command(name: str) -> Callable[[argparse.Namespace], int]:
    """The command function ``name``, imported from its module (`COMMANDS`) when called."""

    def run(args: argparse.Namespace) -> int:
        module = importlib.import_module(f"{__package__}.commands.{COMMANDS[name]}")
        try:
            return int(getattr(module, name)(args) or 0)
        finally:  # however it ends, no worker the command asked for is left starting
            processes = sys.modules.get(f"{__package__}.engine.processes")
            if processes is not None:
                processes.settle()

    run.__name__ = run.__qualname__ = name
    return run


def _stats_parser(sub: Any) -> None:
    """``kvsnap stats``'s arguments."""
    p = sub.add_parser(
        "stats",
        help="per-head statistics (norms, channels, spectrum, ...); prints mean ||K||, outliers flagged",
    )
    stats_arguments(p)
    p.set_defaults(func=command("stats_command"), check=check_outputs, output_formats=TABLES)


def _simulate_parser(sub: Any) -> None:
    """``kvsnap simulate``'s arguments."""
    p = sub.add_parser(
        "simulate",
        help="attention-output error per head if the cache had been compressed (needs --queries)",
    )
    p.add_argument("file")
    p.add_argument("--snapshot", type=int, default=-1, help="which snapshot of a series (default: the last)")
    p.add_argument(
        "--method",
        type=method,
        nargs="+",
        default=None,
        help="streaming, snapkv, pyramidkv, adakv, observed, tova, expected_attention, knorm, keydiff, "
        "lagkv, cur, h2o, random, kivi2, kivi4, token2, token4 (default: every one the file's queries allow)",
    )
    p.add_argument(
        "--budget",
        type=budget,
        nargs="+",
        default=[0.1, 0.25, 0.5],
        help="fractions of the prompt's keys kept (default 0.1 0.25 0.5)",
    )
    p.add_argument(
        "--window",
        type=positive_int,
        help="SnapKV's observation window, queries (default 64, or as many as the file holds right "
        "before the compressed span's end where it holds fewer: said in one line)",
    )
    _method_settings(p)
    p.add_argument(
        "--compress",
        choices=["prompt", "context"],
        default="prompt",
        help="the span compressed: the whole prompt (default), or the context before --question-start "
        "(kvpress's evaluations leave the question uncompressed)",
    )
    p.add_argument(
        "--question-start",
        type=non_negative_int,
        metavar="P",
        help="with --compress context: the position where the question begins",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="Parquet or CSV table (by extension), one row per (method, budget, layer, head)",
    )
    p.add_argument("--plot", help="PNG, SVG or PDF (by extension): error against budget per method")
    p.add_argument(
        "--jobs",
        type=positive_int,
        help="worker processes the layers are spread over (default: every core; a file of fewer than "
        "100,000 query heads x positions, or a URL, stays in this process); the rows are the same whatever "
        "the number",
    )
    remote_options(p)
    force_option(p)
    p.set_defaults(func=command("simulate_command"), check=check_outputs, output_formats=TABLES)


def _method_settings(p: argparse.ArgumentParser) -> None:
    """``kvsnap simulate``'s settings of particular methods (SnapKV's pooling, LagKV, AdaKV, random)."""
    p.add_argument("--kernel", type=odd_int, default=5, help="SnapKV's pooling kernel, keys (odd; default 5)")
    p.add_argument(
        "--pooling", choices=["avg", "max"], default="avg", help="SnapKV's pooling of scores (default avg)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="the random method's sample (each head and budget draws its own)"
    )
    p.add_argument(
        "--lag", type=positive_int, default=128, help="LagKV's partition, keys (default 128, kvpress's)"
    )
    p.add_argument(
        "--adakv-scorer",
        choices=["snapkv", "tova", "expected_attention", "knorm", "keydiff", "lagkv", "cur"],
        default="snapkv",
        help="the scores AdaKV shares a layer's budget by (default snapkv)",
    )


def _outliers_parser(sub: Any) -> None:
    """``kvsnap outliers``'s arguments."""
    p = sub.add_parser("outliers", help="heads whose statistic exceeds N x the median head")
    common_options(p)
    p.add_argument(
        "--stat", default="norm_mean", help="a one-number column of 'kvsnap stats' (default norm_mean)"
    )
    p.add_argument("--tensor", choices=["k", "v"], default="k")
    p.add_argument("--threshold", type=positive_float, default=1.5, help="ratio to the file's median head")
    stats_option(p)
    p.set_defaults(func=command("outliers_command"), check=check_outputs)


def _attention_parser(sub: Any) -> None:
    """``kvsnap attention``'s arguments."""
    p = sub.add_parser(
        "attention",
        help="one query head's attention weights recomputed from saved queries (.npz or .parquet)",
    )
    p.add_argument("file")
    p.add_argument("--layer", type=non_negative_int, required=True)
    p.add_argument("--head", type=non_negative_int, required=True, help="query head")
    p.add_argument("--queries", type=span, metavar="A:B", help="query positions A <= p < B (default: all)")
    p.add_argument("--keys", type=span, metavar="A:B", help="only these key columns (weights over all keys)")
    p.add_argument("--seq", type=non_negative_int, default=0)
    p.add_argument("--snapshot", type=int, default=-1, help="which snapshot of a series (default: last)")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="FILE.npz (the map), or FILE.parquet or FILE.csv (non-zero weights, long form)",
    )
    remote_options(p)
    force_option(p)
    p.set_defaults(func=command("attention_command"), check=check_outputs, output_formats=ATTENTION_FORMATS)


def _plot_parser(sub: Any) -> None:
    """``kvsnap plot``'s arguments."""
    p = sub.add_parser("plot", help="PNG: layers x heads heatmap of a statistic, norm by position")
    p.add_argument("file")
    common_options(p, many=False)
    p.add_argument(
        "--attention",
        type=layer_head,
        metavar="L:H",
        help="instead: the attention map of layer L, query head H (needs a capture with --queries)",
    )
    p.add_argument(
        "--stat",
        help="heatmap statistic: a one-number column of 'kvsnap stats' (default norm_mean), or of "
        "'--stats attention' (sink_mass, retrieval_score, ...: per query head, needs saved queries)",
    )
    p.add_argument("--tensor", choices=["k", "v"], default="k", help="K or V (default k)")
    p.add_argument(
        "--scale",
        choices=["log", "linear"],
        default="log",
        help="with --attention: the map's colour scale (default log; a strip below it shows the mean "
        "weight each key receives on a linear scale)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="PNG, SVG or PDF file, by its extension (written under exactly this name)",
    )
    p.add_argument(
        "--token-labels",
        action="store_true",
        help="label positions with their tokens (if the file records them)",
    )
    p.add_argument(
        "--kept",
        type=kept,
        metavar="METHOD:BUDGET",
        help="with --attention: shade the keys an eviction method (streaming, snapkv, observed, h2o, random) "
        "would evict at that budget, as 'kvsnap simulate' chooses them, e.g. snapkv:0.25",
    )
    p.add_argument(
        "--window",
        type=positive_int,
        help="with --kept snapkv:B: SnapKV's observation window, queries (default as 'kvsnap simulate')",
    )
    stats_option(p)
    force_option(p)
    p.set_defaults(
        func=command("plot_command"), check=check_outputs, heatmap_from_queries=True, output_formats=FIGURES
    )


def _export_parser(sub: Any) -> None:
    """``kvsnap export``'s arguments."""
    p = sub.add_parser(
        "export",
        help="one file per layer and head (L00-H00.csv, as go-mlx probes), streamed head by head; or "
        "artifacts kvpress loads (DuoAttention's head pattern, ExpectedAttention's query statistics)",
    )
    p.add_argument(
        "files",
        nargs="+",
        metavar="file",
        help="a capture (several, or patterns, for --expected-attention-stats: pooled)",
    )
    p.add_argument(
        "-o",
        "--output",
        help="a folder (created if missing): only export's own L..-H.. files are written there; an "
        "existing one of them is refused without --force",
    )
    p.add_argument(
        "--duo-attention",
        metavar="DIR",
        help="write DuoAttention's full_attention_heads.tsv and config.json (kvpress's DuoAttentionPress) "
        "from the capture's streaming_error and retrieval_score (needs --queries)",
    )
    p.add_argument(
        "--window",
        type=positive_int,
        default=256,
        help="with --duo-attention: the recent keys a streaming head keeps (default 256)",
    )
    p.add_argument(
        "--expected-attention-stats",
        metavar="DIR",
        help="write model.safetensors and config.json for kvpress's ExpectedAttentionStatsPress"
        "(stats_folder=DIR): the pre-RoPE query mean and covariance per layer and head, pooled over the "
        "files (needs --queries)",
    )
    p.add_argument("--layer", type=non_negative_int, action="append", help="only this layer (repeatable)")
    p.add_argument("--head", type=non_negative_int, action="append", help="only this head (repeatable)")
    p.add_argument("--format", choices=["csv", "npy", "npz", "parquet"], default="csv")
    p.add_argument("--snapshot", type=int, default=-1)
    keys_option(p)
    remote_options(p)
    force_option(p)
    p.set_defaults(func=command("export_command"), check=check_outputs, output_folder=True)


def _diff_parser(sub: Any) -> None:
    """``kvsnap diff``'s arguments."""
    p = sub.add_parser("diff", help="compare two captures head by head at the positions both hold")
    p.add_argument("a", help="reference capture (A)")
    p.add_argument("b", help="capture compared with it (B)")
    p.add_argument("-o", "--output", help="write every (layer, head, seq, tensor) row as Parquet or CSV")
    p.add_argument("--plot", help="PNG, SVG or PDF: layers x heads heatmap of rel_error, K and V")
    p.add_argument("--snapshot-a", type=int, default=-1, help="snapshot of A (default: last)")
    p.add_argument("--snapshot-b", type=int, default=-1, help="snapshot of B (default: last)")
    p.add_argument(
        "--tolerance",
        type=positive_float,
        default=1e-3,
        help="row relative error ||B_t - A_t|| / ||A_t|| that counts as divergent (default 1e-3)",
    )
    p.add_argument("--top", type=positive_int, default=10, help="worst heads to print (default 10)")
    p.add_argument(
        "--all-positions",
        action="store_true",
        help="also compare positions after the files' token ids diverge (by default only those before)",
    )
    keys_option(p)
    remote_options(p)
    force_option(p)
    p.set_defaults(func=command("diff_command"), check=check_outputs, output_formats=TABLES)


def _view_parser(sub: Any) -> None:
    """``kvsnap view``'s arguments."""
    p = sub.add_parser(
        "view",
        help="an attention explorer in the browser: head grid, maps, tokens, K/V (served locally, or --html)",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="one capture, or two to compare head by head")
    p.add_argument("--html", metavar="OUT.html", help="write one self-contained page instead of serving")
    p.add_argument("--layers", metavar="L,L,...", help="with --html: the layers whose maps the page holds")
    p.add_argument("--heads", metavar="H,H,...", help="with --html: the heads whose maps the page holds")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine)"
    )
    p.add_argument("--port", type=non_negative_int, default=0, help="port (default: a free one)")
    p.add_argument("--no-browser", action="store_true", help="print the URL, do not open a browser")
    remote_options(p)
    force_option(p)
    p.set_defaults(func=command("view_command"))


def _similarity_parser(sub: Any) -> None:
    """``kvsnap similarity``'s arguments."""
    p = sub.add_parser("similarity", help="cross-head and cross-layer linear CKA and cosine")
    common_options(p, engines=False)
    p.add_argument("--tensor", choices=["k", "v"], default="k")
    p.add_argument("--top", type=positive_int, default=5, help="pairs to print per kind")
    p.add_argument("-o", "--output", help="write every pair as Parquet or CSV")
    force_option(p)
    p.set_defaults(func=command("similarity_command"), check=check_outputs, output_formats=TABLES)


PARSERS = (
    _stats_parser,
    _simulate_parser,
    _outliers_parser,
    _attention_parser,
    _plot_parser,
    _export_parser,
    _diff_parser,
    _view_parser,
    _similarity_parser,
)
"""The analysis commands' parser declarations, in the order ``kvsnap --help`` lists them."""


def register(sub: Any) -> None:
    """Declare the analysis commands (`PARSERS`); each runs from its module (`COMMANDS`)."""
    for declare in PARSERS:
        declare(sub)
