"""analysis: per-head statistics streamed out of `.kv` files into Arrow / Polars (bounded memory).

Installed as `kvsnap.analysis`. Never imports `kvsnap.capture`: it reads files only (local paths
or URLs). `kvsnap.analysis.engine.batch` runs many files on local processes or Ray
(`kvsnap.analysis.engine.ray`, imported only when asked for).

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
    from .attention.compression import simulate
    from .attention.head_importance import attention_stats
    from .engine.batch import BatchOptions, BatchResult, FileFailure, expand_paths, merged_stats, run_stats
    from .engine.tables import head_stats, head_stats_reader, head_stats_table, outliers, token_table
    from .stats.accumulator import HeadAccumulator
    from .stats.rope import Rope, RopeError, checkpoint_keys
    from .tools.diff import head_diff
    from .tools.export import export_heads
    from .tools.similarity import head_similarity, similarity_for_file
    from .viewer.notebook import view

_EXPORTS = {
    **dict.fromkeys(
        ("BatchOptions", "BatchResult", "FileFailure", "expand_paths", "merged_stats", "run_stats"),
        "engine.batch",
    ),
    "head_diff": "tools.diff",
    "export_heads": "tools.export",
    "attention_stats": "attention.head_importance",
    "simulate": "attention.compression",
    "view": "viewer.notebook",
    "Rope": "stats.rope",
    "RopeError": "stats.rope",
    "checkpoint_keys": "stats.rope",
    "head_similarity": "tools.similarity",
    "similarity_for_file": "tools.similarity",
    **dict.fromkeys(
        (
            "head_stats",
            "head_stats_reader",
            "head_stats_table",
            "outliers",
            "token_table",
        ),
        "engine.tables",
    ),
    "HeadAccumulator": "stats.accumulator",
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
    "head_diff",
    "head_similarity",
    "head_stats",
    "head_stats_reader",
    "head_stats_table",
    "merged_stats",
    "outliers",
    "run_stats",
    "similarity_for_file",
    "simulate",
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
