"""`kvsnap export` (a file per layer and head) and `kvsnap attention` (a query head's weights to a file)."""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import kvformat
from kvformat.attention import check_selection
from kvformat.io.outputs import output_path

from ..dependencies import pl, tqdm
from ..tools.export import export_heads
from .common import inputs, url_options


def export_command(args: argparse.Namespace) -> int:
    written = 0
    paths = export_heads(
        args.file,
        args.output,
        layers=args.layer,
        heads=args.head,
        fmt=args.format,
        keys=args.keys,
        snapshot=args.snapshot,
        storage_options=url_options(args),
        force=args.force,
    )
    for _ in tqdm.tqdm(paths, unit="head", file=sys.stderr, disable=None, leave=False):
        written += 1
    print(f"wrote {written} {args.format} file(s) into {args.output} (one per layer and head)")
    return 0


def attention_command(args: argparse.Namespace) -> int:
    """One query head's attention weights, recomputed from the file, to .npz or Parquet."""

    with kvformat.open(args.file, args.snapshot, storage_options=url_options(args)) as snap:
        check_selection(snap, args.layer, args.head, queries=args.queries, keys=args.keys, seq=args.seq)
        found = snap.attention(args.layer, args.head, queries=args.queries, keys=args.keys, seq=args.seq)
    suffix = os.path.splitext(args.output)[1].lower()
    with output_path(args.output, inputs=inputs(args), force=args.force) as temporary:
        if suffix == ".parquet":
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
