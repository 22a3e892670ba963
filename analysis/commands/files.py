"""`kvsnap export` (a file per layer and head) and `kvsnap attention` (a query head's weights to a file)."""

from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvformat
from kvformat.attention import check_selection
from kvformat.io.outputs import output_path
from kvsnap.errors import OptionsConflictError

from ..dependencies import pl, tqdm
from ..tools.export import export_heads
from ..tools.kvpress_export import write_duo_attention, write_expected_attention_stats
from .common import FromArgs, inputs, url_options


@dataclass(frozen=True)
class ExportOptions(FromArgs):
    """``kvsnap export``'s options, typed (`from_args`)."""

    files: list[str] = field(default_factory=list)
    output: str | None = None
    duo_attention: str | None = None
    window: int = 256
    expected_attention_stats: str | None = None
    layer: list[int] | None = None
    head: list[int] | None = None
    format: str = "csv"
    snapshot: int = -1
    keys: str = "post_rope"
    force: bool = False


def _one_file(options: ExportOptions, what: str) -> str:
    if len(options.files) != 1:
        raise OptionsConflictError(f"{what} takes one capture, not {len(options.files)}")
    return options.files[0]


def export_command(args: argparse.Namespace) -> int:
    options = ExportOptions.from_args(args)
    if not (options.output or options.duo_attention or options.expected_attention_stats):
        raise OptionsConflictError(
            "export writes -o DIR (a file per head), --duo-attention DIR or --expected-attention-stats DIR"
        )
    if options.duo_attention:
        path = _one_file(options, "--duo-attention")
        _said(write_duo_attention(path, options.duo_attention, window=options.window, force=options.force))
    if options.expected_attention_stats:
        names = [found for name in options.files for found in _matches(name)]
        _said(write_expected_attention_stats(names, options.expected_attention_stats, force=options.force))
    if options.output:
        return _export_heads(options, args)
    return 0


def _said(paths: list[str]) -> None:
    for path in paths:
        print(f"wrote {path}")


def _matches(name: str) -> list[str]:
    """The files a glob pattern matches, sorted; any other name as it is."""
    return sorted(glob.glob(name)) if glob.has_magic(name) else [name]


def _export_heads(options: ExportOptions, args: argparse.Namespace) -> int:
    assert options.output is not None
    written = 0
    paths = export_heads(
        _one_file(options, "-o"),
        options.output,
        layers=options.layer,
        heads=options.head,
        fmt=options.format,
        keys=options.keys,
        snapshot=options.snapshot,
        storage_options=url_options(args),
        force=options.force,
    )
    for _ in tqdm.tqdm(paths, unit="head", file=sys.stderr, disable=None, leave=False):
        written += 1
    print(f"wrote {written} {options.format} file(s) into {options.output} (one per layer and head)")
    return 0


@dataclass(frozen=True)
class AttentionOptions(FromArgs):
    """``kvsnap attention``'s options, typed (`from_args`)."""

    file: str = ""
    layer: int = 0
    head: int = 0
    queries: tuple[int, int] | None = None
    keys: tuple[int, int] | None = None
    seq: int = 0
    snapshot: int = -1
    output: str = ""
    force: bool = False


def attention_command(args: argparse.Namespace) -> int:
    """One query head's attention weights, recomputed from the file, to .npz or Parquet."""
    options = AttentionOptions.from_args(args)

    with kvformat.open(options.file, options.snapshot, storage_options=url_options(args)) as snap:
        check_selection(
            snap, options.layer, options.head, queries=options.queries, keys=options.keys, seq=options.seq
        )
        found = snap.attention(
            options.layer, options.head, queries=options.queries, keys=options.keys, seq=options.seq
        )
    suffix = os.path.splitext(options.output)[1].lower()
    with output_path(options.output, inputs=inputs(args), force=options.force) as temporary:
        if suffix in (".parquet", ".csv"):
            rows, columns = np.nonzero(found.weights)
            table: dict[str, Any] = {
                "query_position": found.query_positions[rows],
                "key_position": found.key_positions[columns],
                "weight": found.weights[rows, columns],
            }
            if found.pooled_keys:  # format 1.8: the last columns are pooled groups, by group index
                table["pooled"] = columns >= found.weights.shape[1] - found.pooled_keys
            long = pl.DataFrame(table)
            long.write_parquet(temporary) if suffix == ".parquet" else long.write_csv(temporary)
        else:
            with open(temporary, "xb") as f:
                np.savez(
                    f,
                    weights=found.weights,
                    query_positions=found.query_positions,
                    key_positions=found.key_positions,
                    pooled_keys=np.int64(found.pooled_keys),  # the last columns' count: pooled groups
                )
    form = "non-zero weights, long form" if suffix in (".parquet", ".csv") else "float32"
    count, keys = found.weights.shape
    where = f"layer {options.layer} query head {options.head}"
    pooled = f", the last {found.pooled_keys} pooled groups" if found.pooled_keys else ""
    print(f"wrote {options.output}: {where}, {count} queries x {keys} keys{pooled} ({form})")
    return 0
