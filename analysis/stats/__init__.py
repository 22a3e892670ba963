"""What a per-head statistic is and how it is summed: the catalogue (`catalogue`: every statistic,
its group and formula, every running sum declared once), the sums of one head (`sums.RunningSums`)
and `accumulator.HeadAccumulator` (rows in, statistics out: `rows`), non-finite rows (`finite`),
RoPE (`rope`) and Arrow tables of rows (`arrow`). No pass and no file here: `analysis.engine`
runs those. This package's own names are the catalogue's; it imports nothing else, so that the
kernels (`analysis.kernels`) can fill `sums.RunningSums` below `accumulator`, which calls them.
The formulas are in ``analysis/README.md``.
"""

from .catalogue import ALL, GROUPS, POSITION_BINS, QUANT_BITS, QUANT_GROUP, RANKS, TOP_K, stat_groups

__all__ = [
    "ALL",
    "GROUPS",
    "POSITION_BINS",
    "QUANT_BITS",
    "QUANT_GROUP",
    "RANKS",
    "TOP_K",
    "stat_groups",
]
