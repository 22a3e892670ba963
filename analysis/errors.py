"""The root of the analysis stage's errors: a `kvformat.KVSnapError` (``kvsnap.Error``) and a
``ValueError`` (a request the files cannot answer), so the command line reports each in one
line."""

from __future__ import annotations

from kvformat import KVSnapError


class AnalysisError(KVSnapError, ValueError):
    """An analysis the files cannot give: no queries, layouts that differ, no RoPE description, a
    viewer request outside the file."""


class LayoutMismatchError(AnalysisError):
    """Files compared or merged do not hold the same layers, heads, dims or sequences."""
