"""What the analysis commands share: argument types and options, output checks, saving tables and figures."""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import kvformat
from kvformat.errors import UnknownNameError
from kvformat.io.outputs import check_output, check_output_folder, output_format, output_path, same_file
from kvsnap.arguments import storage_options, typed
from kvsnap.errors import OptionsConflictError

from ..attention.names import SCALARS
from ..dependencies import pa, pa_csv, pq
from ..stats.catalogue import stat_groups
from ..stats.statistic import check_scalar

KEYS = ("snapshot", "seq", "layer", "head", "n_tokens")


class FromArgs:
    """A dataclass of a command's options, built from argparse's namespace (`from_args`:
    `kvsnap.arguments.typed`, the one way every command does it)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        return typed(cls, args)


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
    output_formats: tuple[str, ...] = ()  # what ``-o`` may name (its parser's ``set_defaults``)


TABLES = ("parquet", "csv")  # a table's formats: Parquet, or CSV with list cells as JSON text
FIGURES = ("png", "svg", "pdf")  # a figure's, as matplotlib writes them


def inputs(args: argparse.Namespace) -> list[str]:
    """The local files a command reads (patterns expanded), to keep its outputs off them."""
    shared = Shared.from_args(args)
    return expanded([n for n in (shared.file, shared.a, shared.b) if n] + list(shared.files or []))


def expanded(names: list[str]) -> list[str]:
    """``names`` and the local files their patterns match."""
    found: list[str] = []
    for name in names:
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
        raise OptionsConflictError(
            f"--address {shared.address} names a Ray cluster: add --engine ray, or drop --address"
        )
    _check_stat(shared)
    check_snapshot(shared)
    _check_main_output(shared, args)
    if shared.plot:
        check_output(shared.plot, inputs=inputs(args), force=shared.force)
        output_format(shared.plot, FIGURES, "--plot")
    if shared.output and shared.plot and same_file(shared.output, shared.plot):
        raise OptionsConflictError(f"-o and --plot name the same file {shared.output}")


def _check_main_output(shared: Shared, args: argparse.Namespace) -> None:
    """``-o``: a folder whose files are checked by name as they are written, or a file allowed
    here (not an input, not replaced without ``--force``) in one of the command's formats."""
    if shared.output and shared.output_folder:
        check_output_folder(shared.output)
    elif shared.output:
        check_output(shared.output, inputs=inputs(args), force=shared.force)
        if shared.output_formats:
            output_format(shared.output, shared.output_formats)


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
            raise UnknownNameError(
                f"{exc}, {', '.join(SCALARS)} (per query head, from saved queries)"
            ) from None
        raise


def check_snapshot(shared: Shared) -> None:
    """`kvformat.OutOfRangeError` (one line, exit 2) for a ``--snapshot`` outside a local file."""
    if shared.snapshot is None or shared.snapshot == -1:
        return
    for name in filter(_local_file, [shared.file, *(shared.files or [])]):
        if name:
            try:
                kvformat.open(name, shared.snapshot).close()
            except kvformat.OutOfRangeError as exc:
                raise kvformat.OutOfRangeError(f"--snapshot {shared.snapshot}: {name}: {exc}") from None
            except kvformat.KVFormatError:
                return  # a bad file: the command reports it as it does any other


def _local_file(name: str | None) -> bool:
    """Whether ``name`` is a file on this machine (not a URL, not a pattern)."""
    text = str(name or "")
    return bool(text) and "://" not in text and not glob.has_magic(text) and os.path.isfile(text)


def save_table(table: Any, path: str, args: argparse.Namespace) -> None:
    """Write ``table`` (a Polars DataFrame or an Arrow table) to ``path`` through a temporary
    name, as Parquet or CSV by its extension (`TABLES`); say where."""
    form = output_format(path, TABLES)
    with output_path(path, inputs=inputs(args), force=Shared.from_args(args).force) as temporary:
        if form == "csv":
            write_csv(table if isinstance(table, pa.Table) else table.to_arrow(), temporary)
        elif hasattr(table, "write_parquet"):  # a Polars DataFrame
            table.write_parquet(temporary)
        else:  # an Arrow table, compressed as polars would
            pq.write_table(table, temporary, compression="zstd")
    print(f"wrote {path}: {len(table)} rows")


def write_csv(table: Any, path: str) -> None:
    """An Arrow table as CSV with a header row; a list column's cells as JSON text (``[1, 2]``),
    which CSV has no type for."""
    columns = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            column = pa.array([None if v is None else json.dumps(v) for v in column.to_pylist()], pa.string())
        columns[name] = column
    pa_csv.write_csv(pa.table(columns), path)


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
    """Save ``figure`` at exactly ``path`` as PNG, SVG or PDF by its extension (`FIGURES`)."""
    form = output_format(path, FIGURES)
    with output_path(path, inputs=inputs(args), force=Shared.from_args(args).force) as temporary:
        figure.savefig(temporary, dpi=110, format=form)


def url_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--storage-option KEY=VALUE`` pairs as fsspec's options (None without any)."""
    return storage_options(Shared.from_args(args).storage_option)
