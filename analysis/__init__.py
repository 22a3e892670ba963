"""analysis: per-head statistics streamed out of `.kv` files into Arrow / Polars (bounded memory).

Installed as `kvsnap.analysis`. Never imports `kvsnap.capture`: it reads files only (local paths
or URLs). `kvsnap.analysis.batch` runs many files on local processes or Ray
(`kvsnap.analysis.ray`, imported only when asked for).

Names load on first use (PEP 562): importing a submodule, such as the CLI's, does not load
the compiled kernels, pyarrow or polars.
"""

from __future__ import annotations

if __name__ != "kvsnap.analysis":  # the folder analysis/ installs as kvsnap.analysis, under that name alone
    raise ImportError(
        f"analysis/ is the package kvsnap.analysis: import it as kvsnap.analysis, not as {__name__!r} "
        "(install the repository: pip install -e .)"
    )

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batch import (
        BatchOptions,
        BatchResult,
        FileFailure,
        expand_paths,
        merged_stats,
        run_stats,
    )
    from .compression import simulate
    from .diff import head_diff
    from .export import export_heads
    from .head_importance import attention_stats
    from .rope import Rope, RopeError, checkpoint_keys
    from .similarity import head_similarity, similarity_for_file
    from .stats import (
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
    from .viewer.notebook import view

_EXPORTS = {
    **dict.fromkeys(
        ("BatchOptions", "BatchResult", "FileFailure", "expand_paths", "merged_stats", "run_stats"), "batch"
    ),
    "head_diff": "diff",
    "export_heads": "export",
    "attention_stats": "head_importance",
    "simulate": "compression",
    "view": "viewer.notebook",
    "Rope": "rope",
    "RopeError": "rope",
    "checkpoint_keys": "rope",
    "head_similarity": "similarity",
    "similarity_for_file": "similarity",
    **dict.fromkeys(
        (
            "HeadAccumulator",
            "file_accumulators",
            "file_tables",
            "head_stats",
            "head_stats_reader",
            "outliers",
            "stats_for_file",
            "stats_rows",
            "token_table",
        ),
        "stats",
    ),
}

__all__ = [
    "BatchOptions",
    "BatchResult",
    "FileFailure",
    "HeadAccumulator",
    "Rope",
    "RopeError",
    "attention_stats",
    "checkpoint_keys",
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
    "simulate",
    "stats_for_file",
    "stats_rows",
    "token_table",
    "view",
]  # the same names as _EXPORTS (a literal, so tools see the exports)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsnap.analysis' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvsnap.analysis.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *globals()})
