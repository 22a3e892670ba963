"""analysis: per-head statistics streamed out of `.kv` files into Arrow / Polars (bounded memory).

Installed as `kvsnap.analysis`. Never imports `kvsnap.capture`: it reads files only (local paths
or URLs). `kvsnap.analysis.batch` runs many files on local processes or Ray
(`kvsnap.analysis.ray`, imported only when asked for).
"""

from kvsnap.analysis.batch import BatchResult, FileFailure, expand_paths, merged_stats, run_stats
from kvsnap.analysis.diff import head_diff
from kvsnap.analysis.export import export_heads
from kvsnap.analysis.rope import Rope, RopeError
from kvsnap.analysis.similarity import head_similarity, similarity_for_file
from kvsnap.analysis.stats import (
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
    "export_heads",
    "file_accumulators",
    "file_tables",
    "head_diff",
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
