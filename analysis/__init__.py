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

from typing import TYPE_CHECKING

from kvsnap.exports import exports

if TYPE_CHECKING:
    from .attention.compression import simulate
    from .attention.head_importance import attention_stats
    from .engine.accumulator import HeadAccumulator
    from .engine.batch import FileFailure, expand_paths, head_stats
    from .stats.outliers import outliers
    from .stats.rope import Rope, RopeError, checkpoint_keys
    from .tools.diff import head_diff
    from .tools.export import export_heads
    from .tools.similarity import head_similarity, similarity_for_file
    from .tools.state import state_stats
    from .tools.token_table import token_table
    from .viewer.notebook import view

__all__ = [
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
    "outliers",
    "similarity_for_file",
    "simulate",
    "state_stats",
    "token_table",
    "view",
]


__getattr__, __dir__ = exports(__name__, __file__, __all__)
