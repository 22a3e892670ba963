"""analysis: per-head statistics streamed out of `.kv` files into Arrow / Polars (bounded memory).

Never imports `capture`: it reads files only.
"""

from analysis.rope import Rope, RopeError
from analysis.stats import (
    HeadAccumulator,
    head_stats,
    head_stats_reader,
    outliers,
    stats_for_file,
    token_table,
)

__all__ = [
    "HeadAccumulator",
    "Rope",
    "RopeError",
    "head_stats",
    "head_stats_reader",
    "outliers",
    "stats_for_file",
    "token_table",
]
