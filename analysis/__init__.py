"""analysis: per-head statistics streamed out of `.kv` files into Arrow / Polars (bounded memory).

Never imports `capture`: it reads files only.
"""

from analysis.rope import Rope, RopeError
from analysis.similarity import head_similarity, similarity_for_file
from analysis.stats import (
    HeadAccumulator,
    file_tables,
    head_stats,
    head_stats_reader,
    outliers,
    stats_for_file,
    stats_rows,
    token_table,
)

__all__ = [
    "HeadAccumulator",
    "Rope",
    "RopeError",
    "file_tables",
    "head_similarity",
    "head_stats",
    "head_stats_reader",
    "outliers",
    "similarity_for_file",
    "stats_for_file",
    "stats_rows",
    "token_table",
]
