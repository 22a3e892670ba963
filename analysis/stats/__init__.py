"""What a per-head statistic is and how it is summed: the catalogue (`catalogue`: every statistic,
its group and formula, every running sum declared once), the sums of one head (`sums.RunningSums`),
non-finite rows (`finite`), RoPE (`rope`), Arrow tables of rows (`arrow`) and the heads that stand
out (`outliers`). No kernel, pass or file here: the kernels (`analysis.kernels`) fill
`sums.RunningSums`, and `analysis.engine.accumulator.HeadAccumulator` (rows in through a kernel,
statistics out: `engine.rows`) runs them. This package's own names are the catalogue's, loaded on
first use (its group names, `groups`, need the standard library only: the command line checks them
before numpy loads). The formulas are in ``analysis/README.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsnap.exports import exports

if TYPE_CHECKING:
    from .catalogue import POSITION_BINS, QUANT_GROUP, TOP_K
    from .groups import ALL, GROUPS, QUANT_BITS, RANKS, stat_groups

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

__getattr__, __dir__ = exports(__name__, __file__, __all__)
