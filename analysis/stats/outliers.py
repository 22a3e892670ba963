"""Heads whose statistic stands out from the median head of their file (`outliers`), on a table
of per-head statistics."""

from __future__ import annotations

from ..dependencies import pl


def outliers(
    table: pl.DataFrame, factor: float = 1.5, stat: str = "norm_mean", tensor: str = "k"
) -> pl.DataFrame:
    """The ``tensor`` rows with ``ratio_to_median`` (``stat`` / the median head of its file) and
    an ``outlier`` flag where it exceeds ``factor``. NaN and null values (a head whose every
    row held inf or NaN) take no part in the median and are never flagged."""

    rows = table.filter(pl.col("tensor") == tensor)
    value = pl.col(stat).cast(pl.Float64).fill_nan(None)
    ratio = (value / value.median().over("file")).alias("ratio_to_median")
    return rows.with_columns(ratio).with_columns((pl.col("ratio_to_median") > factor).alias("outlier"))
