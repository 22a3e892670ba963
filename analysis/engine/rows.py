"""The catalogue's row of each accumulator, computed from its sums (`RunningSums.row_arrays`),
for many accumulators at once: those of one dim and one selection of groups (a layer's heads)
share each numpy call, stacked on a leading axis, so a layer costs a few dozen calls instead of
a few dozen per head (the rows of a pass are computed beside the threads that drive it, and
every numpy call holds the interpreter's lock).

Every reduction runs along the last, contiguous axis, one stacked accumulator per row: an
accumulator's values do not depend on the others it is stacked with (tests hold a row computed
alone equal to the same row computed in a stack, bit for bit)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import kernels
from ..stats import statistic
from ..stats.catalogue import POSITION_BINS, QUANT_BITS, RANKS, hist_quantiles

if TYPE_CHECKING:
    from ..stats.sums import RunningSums


def compute(accumulators: Sequence[RunningSums]) -> None:
    """Compute the row of each accumulator not computed yet (its pending device work folded in
    first), stacking those of one dim and groups."""
    stacks: dict[tuple[int, frozenset[str]], list[RunningSums]] = {}
    for acc in accumulators:
        acc.settle()
        if acc.computed_row is None:
            stacks.setdefault((acc.dim, acc.groups), []).append(acc)
    for stack in stacks.values():
        for acc, row in zip(stack, statistics(stack), strict=True):
            acc.computed_row = row


def statistics(accumulators: Sequence[RunningSums]) -> list[dict[str, Any]]:
    """The rows of ``accumulators`` (one dim, one selection of groups, their sums settled):
    ``n_tokens`` (the rows the statistics are over), ``nonfinite_rows`` and ``nonfinite_values``
    (rows left out for holding inf or NaN, and those values) first, then the columns of their
    groups (see analysis/README.md)."""
    rows: list[dict[str, Any]] = [
        {
            "n_tokens": acc.count,
            "nonfinite_rows": acc.nonfinite_rows,
            "nonfinite_values": acc.nonfinite_values,
        }
        for acc in accumulators
    ]
    live = [i for i, acc in enumerate(accumulators) if acc.count]
    if not live:
        return rows
    stack = [accumulators[i] for i in live]
    groups = stack[0].groups
    parts = _group_columns(stack, groups)
    added = statistic.active(groups)
    for b, i in enumerate(live):
        for part in parts:
            rows[i].update(part[b])
        if added:
            rows[i].update(statistic.values(added, stack[b].sums_by_name()))
    return rows


def _group_columns(stack: list[RunningSums], groups: frozenset[str]) -> list[list[dict[str, Any]]]:
    """Per group of ``groups`` in the catalogue's order, the columns of each accumulator of
    ``stack`` (every one holding rows)."""
    n = np.array([acc.count for acc in stack], np.float64)
    power = np.stack([acc.power for acc in stack]) / n[:, None, None]  # (B, 4, dim) moments
    columns = {
        "norms": lambda: _norms(stack, n),
        "channels": lambda: _channels(stack, power),
        "rope": lambda: [{"rope_band_energy": _band_energy(acc.band)} for acc in stack],
        "spectrum": lambda: _spectrum(stack, n, power[:, 0]),
        "quant": lambda: [_quant(acc) for acc in stack],
    }
    return [make() for group, make in columns.items() if group in groups]


def _band_energy(band: np.ndarray | None) -> np.ndarray | None:
    """The RoPE bands' share of the energy (None where the group held no bands)."""
    return None if band is None else band / max(float(band.sum()), 1e-30)


def medians(values: np.ndarray) -> np.ndarray:
    """``(B,)``: the median of each row of ``values`` ``(B, m)`` (the middle value, or the mean of
    the two middle ones; NaN where a value is NaN)."""
    ordered = np.sort(values, axis=-1)
    m = ordered.shape[-1]
    if not m:
        return np.full(ordered.shape[0], np.nan)
    middle = m // 2
    median = ordered[:, middle] if m % 2 else (ordered[:, middle - 1] + ordered[:, middle]) / 2.0
    return np.where(np.isnan(ordered[:, -1]), np.nan, median)


def _norms(stack: Sequence[RunningSums], n: np.ndarray) -> list[dict[str, Any]]:
    p50, p99 = hist_quantiles(np.stack([acc.norm_hist for acc in stack]), (0.5, 0.99)).T.tolist()
    counts = np.stack([acc.position_count for acc in stack])
    by_position = np.full(counts.shape, np.nan)
    np.divide(np.stack([acc.position_norm for acc in stack]), counts, out=by_position, where=counts > 0)
    held = counts > 0
    last = np.where(held.any(axis=-1), POSITION_BINS - np.argmax(held[:, ::-1], axis=-1), 0).tolist()
    unit = np.stack([acc.unit_sum for acc in stack]) / n[:, None]
    anisotropy = np.sqrt(np.square(unit).sum(axis=-1)).tolist()
    out = []
    for b, acc in enumerate(stack):
        count = acc.count
        mean_norm = acc.norm_sum / count
        sq_mean = acc.norm_sq_sum / count
        out.append(
            {
                "norm_mean": mean_norm,
                "norm_std": float(np.sqrt(max(sq_mean - mean_norm**2, 0.0))),
                "norm_min": acc.norm_min,
                "norm_max": acc.norm_max,
                "norm_p50": p50[b],
                "norm_p99": p99[b],
                "norm_sq_mean": sq_mean,
                # NaN without position 0, and for a head of zero vectors (0 / 0: a sparse
                # attention indexer's cache stores zeros as its values)
                "sink_ratio": acc.first_norm_sum / acc.first_count / mean_norm
                if acc.first_count and mean_norm > 0
                else float("nan"),
                "norm_by_position": by_position[b, : last[b]],
                "anisotropy": anisotropy[b],
            }
        )
    return out


def _channels(stack: Sequence[RunningSums], power: np.ndarray) -> list[dict[str, Any]]:
    m1, m2, m3, m4 = power[:, 0], power[:, 1], power[:, 2], power[:, 3]
    var = np.maximum(m2 - m1 * m1, 0.0)
    central4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1**4
    positive = var > 0
    kurtosis = np.full(var.shape, np.nan)
    np.divide(central4, var * var, out=kurtosis, where=positive)
    np.subtract(kurtosis, 3.0, out=kurtosis, where=positive)
    peak_medians = hist_quantiles(np.stack([acc.peak_hist for acc in stack]), (0.5,))[:, 0].tolist()
    absmax = np.stack([acc.absmax for acc in stack])
    outlier = (absmax.max(axis=-1) / np.maximum(medians(absmax), 1e-30)).tolist()
    out = []
    for b, acc in enumerate(stack):
        peak_median = peak_medians[b]
        out.append(
            {
                "channel_mean": m1[b],
                "channel_var": var[b],
                "channel_absmax": absmax[b],
                "outlier_channel_ratio": outlier[b],
                "channel_kurtosis": kurtosis[b],
                "massive_positions": [p for _, p in acc.top],
                "massive_values": [v for v, _ in acc.top],
                "massive_ratio": acc.top[0][0] / peak_median if acc.top and peak_median > 0 else float("nan"),
            }
        )
    return out


def _spectrum(stack: Sequence[RunningSums], n: np.ndarray, m1: np.ndarray) -> list[dict[str, Any]]:
    # In place: each (b, dim, dim) temporary is megabytes of fresh pages, faulted in on every call.
    covariance = np.stack([acc.gram for acc in stack])
    covariance /= n[:, None, None]
    for b in range(len(stack)):
        covariance[b] -= np.outer(m1[b], m1[b])
    descending = kernels.profile(stack[0].backend).eigenvalues(covariance)
    eig = np.clip(descending, 0.0, None)
    total = eig.sum(axis=-1)
    positive = total > 0
    scale = np.where(positive, total, 1.0)[:, None]
    cumulative = np.where(positive[:, None], np.cumsum(eig, axis=-1) / scale, 1.0)
    rank_90 = ((cumulative < 0.9).sum(axis=-1) + 1).tolist()
    probabilities = eig / scale
    mass = probabilities > 0
    entropy_terms = np.where(mass, probabilities * np.log(np.where(mass, probabilities, 1.0)), 0.0)
    any_mass = mass.any(axis=-1)
    effective = np.where(any_mass, np.exp(-entropy_terms.sum(axis=-1)), 0.0).tolist()
    kept = {r: np.where(positive, eig[:, :r].sum(axis=-1) / scale[:, 0], 1.0).tolist() for r in RANKS}
    out = []
    for b in range(len(stack)):
        row: dict[str, Any] = {"eigenvalues": eig[b], "rank_90": rank_90[b], "effective_rank": effective[b]}
        for r in RANKS:
            row[f"rank{r}_error"] = 1.0 - kept[r][b]
        out.append(row)
    return out


def _quant(acc: RunningSums) -> dict[str, float]:
    energy = acc.norm_sq_sum
    row = {}
    for i, bits in enumerate(QUANT_BITS):
        for axis, sums in (("token", acc.quant_token), ("channel", acc.quant_channel)):
            row[f"quant{bits}_{axis}_error"] = float(sums[i] / energy) if energy else float("nan")
    return row
