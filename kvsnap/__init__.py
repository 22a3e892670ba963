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

import importlib
import types
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **{
        name: "kvformat"
        for name in (
            "open",
            "save",
            "recover",
            "import_mlxkv",
            "import_bundles",
            "Writer",
            "Layer",
            "LayerSpec",
            "KVFormatError",
        )
    },
    **{
        name: "kvsnap.analysis"
        for name in (
            "head_stats",
            "head_stats_reader",
            "head_stats_table",
            "token_table",
            "outliers",
            "head_similarity",
            "head_diff",
            "run_stats",
            "merged_stats",
            "export_heads",
            "checkpoint_keys",
            "attention_stats",
            "simulate",
            "view",
        )
    },
    **{
        name: "kvsnap.capture"
        for name in ("generate", "snapshot_kv", "restore", "tokens_of", "text_of", "fetch_model")
    },
}
_SUBPACKAGES = ("analysis", "capture")

__all__ = sorted([*_EXPORTS, *_SUBPACKAGES, "Error"])


def __getattr__(name: str) -> Any:
    if name == "Error":  # the root of every error kvsnap raises on purpose
        from kvformat import KVSnapError

        return KVSnapError
    if name in _SUBPACKAGES:
        return importlib.import_module(f"kvsnap.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsnap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if isinstance(value, types.ModuleType):
        # A submodule of the same name (``kvsnap.capture.generate``), imported before: once it is,
        # the package attribute is that module; the function is the module's attribute.
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
