"""What the analysis commands share: argument types and options, output checks, saving tables and figures."""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, Self

import kvformat
from kvformat.io.outputs import check_output, check_output_folder, output_path, same_file
from kvsnap.cli.options import positive_int, storage_options

from ..attention.names import EVICTION, METHODS, SCALARS
from ..dependencies import pq
from ..kernels import CHOICES as BACKENDS
from ..stats.catalogue import GROUPS, check_scalar, stat_groups

KEYS = ("snapshot", "seq", "layer", "head", "n_tokens")


class FromArgs:
    """A dataclass of a command's options, built from argparse's namespace (`from_args`): the
    fields the command's parser declares, the others at their defaults."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        given = vars(args)
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        return cls(**{name: given[name] for name in names if name in given})


@dataclass(frozen=True)
class Shared(FromArgs):
    """The options the analysis commands share, typed (`from_args`): each command's parser
    declares those it offers; the others keep these defaults."""

    file: str | None = None
    a: str | None = None
    b: str | None = None
    files: list[str] = field(default_factory=list)
    snapshot: int | None = None
    stats: frozenset[str] | None = None
    stat: str | None = None
    attention: tuple[int, int] | None = None
    engine: str = "local"
    address: str | None = None
    output: str | None = None
    output_folder: bool = False
    plot: str | None = None
    force: bool = False
    storage_option: list[str] | None = None


def inputs(args: argparse.Namespace) -> list[str]:
    """The local files a command reads (patterns expanded), to keep its outputs off them."""
    shared = Shared.from_args(args)
    found: list[str] = []
    for name in [n for n in (shared.file, shared.a, shared.b) if n] + list(shared.files or []):
        found.append(name)
        if "://" not in name and glob.has_magic(name):
            found += glob.glob(name, recursive=True)
    return found


@contextlib.contextmanager
def warnings_printed(category: type[Warning] = UserWarning) -> Iterator[None]:
    """Warnings of ``category`` raised inside, printed as ``kvsnap: warning: ...`` lines on
    stderr once the block is done (one line each, never a Python warning's two)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", category)
        yield
    for warning in caught:
        print(f"kvsnap: warning: {warning.message}", file=sys.stderr)


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Before any work: every output the command will write is allowed (`kvformat.io.outputs`), a
    ``--stat`` names a statistic the selected groups compute, and ``--snapshot`` is inside each
    local file named (reading only its index)."""
    del parser
    shared = Shared.from_args(args)
    if shared.address and shared.engine != "ray":
        raise ValueError(
            f"--address {shared.address} names a Ray cluster: add --engine ray, or drop --address"
        )
    _check_stat(shared)
    check_snapshot(shared)
    if shared.output and shared.output_folder:
        check_output_folder(shared.output)  # files written into it are checked by name
    elif shared.output:
        check_output(shared.output, inputs=inputs(args), force=shared.force)
    if shared.plot:
        check_output(shared.plot, inputs=inputs(args), force=shared.force)
    if shared.output and shared.plot and same_file(shared.output, shared.plot):
        raise ValueError(f"-o and --plot name the same file {shared.output}")


def _check_stat(shared: Shared) -> None:
    """A ``--stat`` the selected ``--stats`` groups compute (`plot --attention` has none; `plot
    --stat sink_mass` and other per-query-head statistics come from saved queries, checked there)."""
    if shared.stat is None or shared.attention is not None:
        return
    if shared.stat in SCALARS:  # per query head, from saved queries (`--stats attention`)
        return
    try:
        check_scalar(shared.stat, stat_groups(shared.stats))
    except ValueError as exc:
        if "no such statistic" in str(exc):
            raise ValueError(f"{exc}, {', '.join(SCALARS)} (per query head, from saved queries)") from None
        raise


def check_snapshot(shared: Shared) -> None:
    """`kvformat.OutOfRangeError` (one line, exit 2) for a ``--snapshot`` outside a local file."""
    if shared.snapshot is None or shared.snapshot == -1:
        return
    for name in [shared.file, *(shared.files or [])]:
        if name and "://" not in name and not glob.has_magic(name) and os.path.isfile(name):
            try:
                kvformat.open(name, shared.snapshot).close()
            except kvformat.KVFormatError:
                return  # a bad file: the command reports it as it does any other


def save_parquet(table: Any, path: str, args: argparse.Namespace) -> None:
    """Write ``table`` (a Polars DataFrame or an Arrow table) to ``path`` through a temporary
    name; say where."""
    with output_path(path, inputs=inputs(args), force=args.force) as temporary:
        if hasattr(table, "write_parquet"):  # a Polars DataFrame
            table.write_parquet(temporary)
        else:  # an Arrow table, compressed as polars would
            pq.write_table(table, temporary, compression="zstd")
    print(f"wrote {path}: {len(table)} rows")


class ParquetSink:
    """Arrow tables written to one Parquet file as they arrive, a row group each (a batch's
    files, while the others are still computed: the write no longer waits for the last one).
    `finish` closes it, or writes the whole ``rows`` at once where the tables' schemas differed
    (files of other layouts: ``rows`` is their union) or did not add up to ``rows`` (a file that
    failed after some of its layers were written)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.writer: Any = None
        self.rows = 0
        self.mixed = False

    def add(self, table: Any) -> None:
        """Write ``table`` (an Arrow table) after the ones before it."""
        if self.mixed or not table.num_rows:
            return
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, table.schema, compression="zstd")
        elif not table.schema.equals(self.writer.schema):
            self.mixed = True
            return
        self.writer.write_table(table)
        self.rows += table.num_rows

    def finish(self, rows: Any) -> None:
        """Close the file; it then holds exactly ``rows`` (an Arrow table)."""
        if self.writer is not None:
            self.writer.close()
        if self.writer is None or self.mixed or self.rows != rows.num_rows:
            pq.write_table(rows, self.path, compression="zstd")


def save_figure(figure: Any, path: str, args: argparse.Namespace) -> None:
    """Save ``figure`` as PNG at exactly ``path`` (matplotlib would add ``.png`` to a bare name)."""
    with output_path(path, inputs=inputs(args), force=args.force) as temporary:
        figure.savefig(temporary, dpi=110, format="png")


def url_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--storage-option KEY=VALUE`` pairs as fsspec's options (None without any)."""
    return storage_options(Shared.from_args(args).storage_option)


def stat_groups_type(text: str) -> frozenset[str]:
    """argparse type: comma-separated statistic groups (``all``, ``norms``, ``channels``, ...)."""
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
    except ValueError as exc:  # the groups of `stats`, and the attention group beside them
        raise argparse.ArgumentTypeError(f"{exc}, attention") from None


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


def stats_option(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="cpu",
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
