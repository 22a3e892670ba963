"""kvsnap: KV-cache snapshots of MLX language models, captured, stored and analysed.

    import kvsnap

    snap = kvsnap.open("run.kv")                    # the .kv reader (kvformat.open)
    table = kvsnap.head_stats(["run.kv"])          # per-head statistics (needs kvsnap[analysis])
    for response in kvsnap.generate(model, tokenizer, prompt, output="run.kv", every=16):
        ...                                         # capture while generating (needs kvsnap[capture])

The stages are subpackages: `kvsnap.capture` (the repository's ``capture/`` folder) and
`kvsnap.analysis` (``analysis/``); the format is the top-level package `kvformat`, which depends
on numpy, zstandard and ml-dtypes only. Importing `kvsnap` loads none of them: each name below
is imported on first use, so ``import kvsnap`` works with only the base install, and a
researcher's own ``analysis.py`` or ``capture.py`` in the working folder shadows nothing here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsnap import blas
from kvsnap.exports import exports

blas.load()  # $KVSNAP_BLAS, before any stage imports mlx (see kvsnap.blas)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvformat import (
        KVFormatError,
        Layer,
        LayerSpec,
        Writer,
        import_bundles,
        import_mlxkv,
        open,
        recover,
        save,
    )
    from kvformat import KVSnapError as Error  # the root of every error kvsnap raises on purpose

    # (mypy reads the stages as the packages analysis and capture, not under these names)
    from . import analysis, capture
    from .analysis import (  # type: ignore[import-not-found]
        attention_stats,
        checkpoint_keys,
        export_heads,
        head_diff,
        head_similarity,
        head_stats,
        outliers,
        simulate,
        token_table,
        view,
    )
    from .capture import (  # type: ignore[import-not-found]
        fetch_model,
        generate,
        restore,
        snapshot_kv,
        text_of,
        tokens_of,
    )

__all__ = [
    "Error",
    "KVFormatError",
    "Layer",
    "LayerSpec",
    "Writer",
    "analysis",
    "attention_stats",
    "capture",
    "checkpoint_keys",
    "export_heads",
    "fetch_model",
    "generate",
    "head_diff",
    "head_similarity",
    "head_stats",
    "import_bundles",
    "import_mlxkv",
    "open",
    "outliers",
    "recover",
    "restore",
    "save",
    "simulate",
    "snapshot_kv",
    "text_of",
    "token_table",
    "tokens_of",
    "view",
]

__getattr__, __dir__ = exports(__name__, __file__, __all__)
