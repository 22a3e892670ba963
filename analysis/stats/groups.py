"""The statistic groups and their columns, by name: what the command line checks before anything
heavy is imported (this module needs the standard library only). `catalogue` defines each
statistic; these are its names. Statistics added to the catalogue (`statistic`) join these
groups."""

from __future__ import annotations

from collections.abc import Iterable

from ..dependencies import kvformat_errors

QUANT_BITS = (8, 4, 2)  # bit widths of the quantization-error statistics
RANKS = (1, 4, 16)  # rank-r approximation errors

GROUPS: dict[str, tuple[str, ...]] = {
    "norms": (
        "norm_mean",
        "norm_std",
        "norm_min",
        "norm_max",
        "norm_p50",
        "norm_p99",
        "norm_sq_mean",
        "sink_ratio",
        "norm_by_position",
        "anisotropy",
    ),
    "channels": (
        "channel_mean",
        "channel_var",
        "channel_absmax",
        "outlier_channel_ratio",
        "channel_kurtosis",
        "massive_positions",
        "massive_values",
        "massive_ratio",
    ),
    "rope": ("rope_band_energy",),
    "spectrum": ("eigenvalues", "rank_90", "effective_rank", *(f"rank{r}_error" for r in RANKS)),
    "quant": tuple(f"quant{b}_{axis}_error" for b in QUANT_BITS for axis in ("token", "channel")),
}
"""The statistic groups and their columns (``n_tokens`` is always there)."""


ALWAYS = ("n_tokens", "nonfinite_rows", "nonfinite_values")
"""The columns every row has, whatever the groups."""

LIST_COLUMNS = frozenset(
    {"norm_by_position", "channel_mean", "channel_var", "channel_absmax", "channel_kurtosis",
     "massive_positions", "massive_values", "rope_band_energy", "eigenvalues"}
)  # fmt: skip
"""Columns that hold a list per row (the others are one number)."""


ALL = frozenset(GROUPS)


def _names(stats: str | Iterable[str]) -> list[str]:
    """The names in a comma-separated string or an iterable, stripped."""
    return (
        [s.strip() for s in stats.split(",")] if isinstance(stats, str) else [str(s).strip() for s in stats]
    )


def stat_groups(stats: str | Iterable[str] | None = None) -> frozenset[str]:
    """The groups named by ``stats``: ``None`` or ``"all"`` for every group, else names from
    `GROUPS` (a comma-separated string or an iterable); ValueError naming an unknown group."""
    if stats is None:
        return ALL
    names = [n for n in _names(stats) if n]
    if not names:
        raise kvformat_errors.InvalidArgumentError(
            f"no statistic group named; choose from all, {', '.join(GROUPS)}"
        )
    if "all" in names:
        return ALL
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise kvformat_errors.UnknownNameError(
            f"unknown statistic group {unknown[0]!r}; choose from all, {', '.join(GROUPS)}"
        )
    return frozenset(names)
