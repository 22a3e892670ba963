"""``kvsnap stats``: per-head norm statistics of snapshots, outlier heads flagged."""

from __future__ import annotations

import argparse
from typing import Any


def _stats(args: argparse.Namespace) -> int:
    import polars as pl

    from analysis.stats import head_stats, outliers

    table = head_stats(args.files, args.snapshot, args.keys)
    if args.output:
        table.write_parquet(args.output)
        print(f"wrote {args.output}: {table.height} rows")
    flagged = outliers(table, args.factor)
    for name in flagged["file"].unique(maintain_order=True).to_list():
        rows = flagged.filter(pl.col("file") == name)
        print(
            f"{name}: mean ||K|| per layer and KV head ({max(rows['n_tokens'].to_list())} tokens; "
            f"* = above {args.factor}x the median head)"
        )
        layers = sorted(set(rows["layer"].to_list()))
        for layer in layers:
            cells = []
            for row in rows.filter((pl.col("layer") == layer) & (pl.col("seq") == 0)).iter_rows(named=True):
                mark = "*" if row["outlier"] else " "
                cells.append(f"h{row['head']}={row['norm_mean']:7.2f}{mark}")
            print(f"  layer {layer:3d}: " + "  ".join(cells))
        top = rows.sort("ratio_to_median", descending=True).head(3)
        print(
            "  largest: "
            + ", ".join(
                f"layer {r['layer']} head {r['head']} ({r['ratio_to_median']:.2f}x median)"
                for r in top.iter_rows(named=True)
            )
        )
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "stats",
        help="per-head statistics (norms, channels, spectrum, ...); prints mean ||K||, outliers flagged",
    )
    p.add_argument("files", nargs="+")
    p.add_argument("--snapshot", type=int, default=-1)
    p.add_argument("--factor", type=float, default=1.5, help="outlier threshold vs the median head")
    p.add_argument(
        "--keys",
        choices=["post_rope", "pre_rope"],
        default="post_rope",
        help="pre_rope: un-rotate K with the RoPE the snapshot records",
    )
    p.add_argument("-o", "--output", help="write the full statistics table as Parquet")
    p.set_defaults(func=_stats)
