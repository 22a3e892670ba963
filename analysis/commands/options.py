"""The analysis commands' argparse types and shared options, and the ``stats`` command's own
arguments (`stats_arguments`): the definitions the parser is built from and the console script
reads before anything heavy is imported (`analysis.engine.fork_server`: whether the command
will start CPU workers). This module needs the standard library and the names of kernels, groups
and methods only, never numpy."""

from __future__ import annotations

import argparse
import math

from kvsnap.arguments import positive_float, positive_int, remote_options

from ..attention.names import EVICTION, METHODS, NOT_FROM_A_FILE
from ..kernels import CHOICES as BACKENDS
from ..kernels import DEFAULT as DEFAULT_KERNEL
from ..stats.groups import GROUPS, stat_groups


def stats_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``kvsnap stats``."""
    common_options(p)
    p.add_argument("--factor", type=positive_float, default=1.5, help="outlier threshold vs the median head")
    p.add_argument("-o", "--output", help="write the full statistics table as Parquet or CSV (by extension)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="one row per (layer, head, tensor) over all files (they must share the model's layout)",
    )
    stats_option(p)
    p.add_argument(
        "--window",
        type=positive_int,
        default=256,
        help="--stats attention: the recent positions streaming_error keeps beside 4 sinks (default 256)",
    )
    p.add_argument(
        "--needle",
        type=span,
        metavar="A:B",
        help="--stats attention: retrieval_score only for tokens copied from positions A..B-1",
    )
    p.add_argument(
        "--retrieval",
        choices=["generated", "all"],
        default=None,
        help="--stats attention: the queries retrieval_score counts: those that produced a generated "
        "token (default, as Wu et al. 2024), or every stored query (the prompt window's too)",
    )
    force_option(p)


def stat_groups_type(text: str) -> frozenset[str]:
    """argparse type: comma-separated statistic groups (``all``, ``norms``, ``channels``, ...)."""
    named = {name.strip() for name in text.split(",")}
    for own, rows in (("attention", "per query head"), ("state", "per recurrent state array")):
        if own in named:
            if named != {own}:
                raise argparse.ArgumentTypeError(
                    f"{own} rows are {rows}, the other groups' per KV head: ask for --stats {own} on its own"
                )
            return frozenset({own})
    try:
        return stat_groups(text)
    except ValueError as exc:  # the groups of `stats`, and the attention and state groups beside them
        raise argparse.ArgumentTypeError(f"{exc}, attention, state") from None


def span(text: str) -> tuple[int, int]:
    """argparse type: ``A:B`` absolute positions ``A <= p < B`` (either side may be left out)."""
    low, sep, high = text.partition(":")
    try:
        span = (int(low) if low else 0, int(high) if high else 2**53)
    except ValueError:
        span = (0, -1)
    if not sep or span[0] < 0 or span[1] <= span[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: give positions as A:B with 0 <= A < B")
    return span


def layer_head(text: str) -> tuple[int, int]:
    """argparse type: ``L:H`` (a layer and a query head)."""
    layer, sep, head = text.partition(":")
    if not sep or not layer.isdigit() or not head.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a layer and a query head as L:H, e.g. 3:1")
    return int(layer), int(head)


def kept(text: str) -> tuple[str, float]:
    """argparse type: ``METHOD:BUDGET``, an eviction method of `simulate` and a fraction in (0, 1]."""
    name, sep, budget = text.partition(":")
    try:
        fraction = float(budget)
    except ValueError:
        fraction = math.nan
    if not sep or name not in EVICTION or not 0 < fraction <= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give an eviction method ({', '.join(EVICTION)}) and a budget in (0, 1], "
            "e.g. snapkv:0.25"
        )
    return name, fraction


def method(text: str) -> str:
    """argparse type: a `simulate` method."""
    if text in NOT_FROM_A_FILE:
        raise argparse.ArgumentTypeError(NOT_FROM_A_FILE[text])
    if text not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {text!r}: one of {', '.join(METHODS)}")
    return text


def budget(text: str) -> float:
    """argparse type: a budget in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"budget {text} is not in (0, 1]")
    return value


def force_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="replace existing output files (never an input)")


def keys_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keys",
        choices=["post_rope", "pre_rope"],
        default="post_rope",
        help="pre_rope: un-rotate K with the RoPE the snapshot records",
    )


def common_options(p: argparse.ArgumentParser, many: bool = True, engines: bool = True) -> None:
    if many:
        p.add_argument("files", nargs="+")
    p.add_argument(
        "--snapshot",
        type=int,
        default=-1,
        help="which snapshot of a series: 0, 1, ..., or -1 for the last (default)",
    )
    keys_option(p)
    p.add_argument(
        "--jobs",
        type=positive_int,
        help="cores to use (default: all): files in processes, the cores left as each file's workers",
    )
    remote_options(p)
    if many and engines:
        p.add_argument(
            "--engine",
            choices=["local", "ray"],
            default="local",
            help="local: --jobs processes; ray: a Ray cluster (--address) or local Ray with --jobs CPUs",
        )
        p.add_argument("--address", help="Ray cluster address for --engine ray")
        p.add_argument("--fail-fast", action="store_true", help="stop at the first file that fails")


def stats_option(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=DEFAULT_KERNEL,
        help="cpu: the compiled kernel on --jobs cores; mlx: mlx's device (Metal or CUDA GPU, else CPU), "
        "driven by 3/4 of --jobs worker processes for a local file on Linux (each with its own mlx; "
        "one file under 12 GiB without --jobs: one process, which starts faster; at least as many "
        "files as those processes: each process takes whole files)",
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
