"""analysis: per-head statistics streamed out of `.kv` files into Arrow / Polars (bounded memory).

Never imports `capture`: it reads files only (local paths or URLs). `analysis.batch` runs many
files on local processes or Ray (`analysis.ray`, imported only when asked for).
"""

from analysis.batch import BatchResult, FileFailure, expand_paths, merged_stats, run_stats
from analysis.rope import Rope, RopeError
from analysis.similarity import head_similarity, similarity_for_file
from analysis.stats import (
    HeadAccumulator,
    file_accumulators,
    file_tables,
    head_stats,
    head_stats_reader,
    outliers,
    stats_for_file,
    stats_rows,
    token_table,
)

__all__ = [
    "BatchResult",
    "FileFailure",
    "HeadAccumulator",
    "Rope",
    "RopeError",
    "expand_paths",
    "file_accumulators",
    "file_tables",
    "head_similarity",
    "head_stats",
    "head_stats_reader",
    "merged_stats",
    "outliers",
    "run_stats",
    "similarity_for_file",
    "stats_for_file",
    "stats_rows",
    "token_table",
]
