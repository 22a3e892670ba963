"""analysis: per-head statistics streamed out of `.kv` files into Polars (bounded memory)."""

from analysis.norms import head_norms, norm_rows, outliers

__all__ = ["head_norms", "norm_rows", "outliers"]
