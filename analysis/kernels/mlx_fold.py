"""Folding the mlx device's per-piece results into accumulators' float64 sums on the host: one
numpy call per sum across the accumulators of a stacked layout (`accumulator.stack`)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from ..stats.catalogue import POSITION_BINS, TOP_K, position_bins
from ..stats.sums import STACKED
from . import reference
from .arrays import float32_rows

if TYPE_CHECKING:
    from ..stats.sums import RunningSums


def to_host(outputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """A call's outputs copied to host memory (parts joined, `join_results`); the per-row mask
    ``light`` only when a piece has heavy rows (rare: the host then adds their Gram in
    float64)."""
    host = {name: np.array(value) for name, value in outputs.items() if name != "light"}
    if "light" in outputs and host["heavy"].any():
        host["light"] = np.array(outputs["light"])
    return join_results(host)


def join_results(host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs the device returns in parts, joined (the device stacks nothing: on CUDA that
    runs mlx's general copy kernels, `_piece`'s ``top_rows``), batched ``(B, ...)`` or not:
    ``central`` ``(..., 4, dim)`` from ``central:p``; ``top_rows`` and ``top_peaks``
    ``(..., 2, k)``; ``quant_token`` ``(..., bits)`` from ``quant_token:b``; ``quant_channel``
    ``(..., bits, groups)`` from ``quant_channel:b:i`` (a bit width's groups in parts)."""
    parts: dict[str, dict[tuple[int, ...], np.ndarray]] = {}
    for key in [key for key in host if ":" in key]:
        name, *index = key.split(":")
        parts.setdefault(name, {})[tuple(int(i) for i in index)] = host.pop(key)
    for name, pieces in parts.items():
        if name == "quant_channel":
            host[name] = _joined_by_width(pieces)
        else:
            ordered = [pieces[index] for index in sorted(pieces)]
            host[name] = np.stack(ordered, axis=-1 if name == "quant_token" else -2)
    return host


def _joined_by_width(pieces: dict[tuple[int, ...], np.ndarray]) -> np.ndarray:
    """``quant_channel:b:i`` parts joined: each bit width's groups along the last axis, the
    widths stacked before it ``(..., bits, groups)``."""
    widths = sorted({index[0] for index in pieces})
    joined = [
        np.concatenate([pieces[i] for i in sorted(i for i in pieces if i[0] == b)], axis=-1) for b in widths
    ]
    return np.stack(joined, axis=-2)


def _raw_powers(shift: np.ndarray, central: np.ndarray, n: int) -> np.ndarray:
    """``(..., 4, dim)`` float64 sums of x, x^2, x^3, x^4 from sums of ``d = x - shift``
    (``central`` ``(..., 4, dim)``; binomial expansion; ``shift`` ``(..., dim)`` is exactly the
    float32 value the device subtracted)."""
    c = shift.astype(np.float64)
    s1, s2, s3, s4 = np.moveaxis(central.astype(np.float64), -2, 0)
    return np.stack(
        [
            s1 + n * c,
            s2 + 2 * c * s1 + n * c**2,
            s3 + 3 * c * s2 + 3 * c**2 * s1 + n * c**3,
            s4 + 4 * c * s3 + 6 * c**2 * s2 + 4 * c**3 * s1 + n * c**4,
        ],
        axis=-2,
    )


def piece_bins(positions: np.ndarray) -> np.ndarray:
    """`catalogue.position_bins` of a piece's positions as uint8 (the device's input); for a run
    (every head of a layer holds the same positions) computed once and cached."""

    n = positions.size
    if n and int(positions[-1]) - int(positions[0]) == n - 1:
        return _run_bins(int(positions[0]), n)[0]
    return position_bins(positions).astype(np.uint8)


def _piece_bin_counts(positions: np.ndarray) -> np.ndarray:
    """How many of a piece's positions fall in each position bin, ``(POSITION_BINS,)`` int64."""

    n = positions.size
    if n and int(positions[-1]) - int(positions[0]) == n - 1:
        return _run_bins(int(positions[0]), n)[1]
    return np.bincount(piece_bins(positions), minlength=POSITION_BINS)


@functools.lru_cache(maxsize=64)
def _run_bins(start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The uint8 bins of positions ``start .. start + count - 1`` and their counts per bin
    (read-only, cached)."""

    bins = position_bins(np.arange(start, start + count, dtype=np.int64)).astype(np.uint8)
    counts = np.bincount(bins, minlength=POSITION_BINS)
    bins.flags.writeable = counts.flags.writeable = False
    return bins, counts


def top_found(
    rows: list[list[int]], peaks: list[list[float]], positions: np.ndarray
) -> list[tuple[float, int]]:
    """A piece's top peaks as ``(peak, position)`` from the device's `top_rows` index sets
    (``rows``, ``peaks``: ``(2, k)``): every row above the k-th largest peak, then the latest
    rows at it until there are k."""
    (above, level), (above_peaks, level_peaks) = rows, peaks
    k = len(above)
    found = [(peak, int(positions[i])) for i, peak in zip(above, above_peaks, strict=True) if i >= 0]
    at_level = sorted(((i, peak) for i, peak in zip(level, level_peaks, strict=True) if i >= 0), reverse=True)
    found += [(peak, int(positions[i])) for i, peak in at_level[: k - len(found)]]
    return found


def shared_stack(
    entries: list[tuple[RunningSums, np.ndarray, np.ndarray]],
) -> tuple[dict[str, np.ndarray], slice | np.ndarray] | None:
    """The stacked sums (`accumulator.stack`) of which every entry's accumulator is a different
    row, with all its sums still views of them (`RunningSums.merge` rebinds them), and the
    entries' rows there (a slice where they follow each other); None otherwise (then the group
    adds one accumulator at a time, in order: e.g. a head with two pieces in one batch)."""

    shared = entries[0][0].layout
    if shared is None:
        return None
    slots = []
    for acc, _, _ in entries:
        if acc.layout is not shared:
            return None
        if any(getattr(acc, name).base is not shared.arrays[name] for name in STACKED):
            return None
        slots.append(acc.slot)
    if len(set(slots)) < len(slots):
        return None
    first = slots[0]
    if slots == list(range(first, first + len(slots))):
        return shared.arrays, slice(first, first + len(slots))
    return shared.arrays, np.array(slots)


def fold_checked(
    entries: list[tuple[RunningSums, np.ndarray, np.ndarray]], out: dict[str, np.ndarray]
) -> None:
    """`fold_group`, after the finiteness check a pipeline's pieces get on the device instead of
    a pass over their bytes on the thread that drives it: a piece whose float32 sum of squares
    (``sq_sum``) is not finite holds an inf or NaN, or squares beyond float32's range; its device
    results are dropped and its rows added on the host by the float64 reference backend
    (`reference.add`), which leaves out the rows holding inf or NaN and counts them, as the CPU
    backend does."""
    finite = np.isfinite(out["sq_sum"])
    if finite.all():
        fold_group(entries, out)
        return
    kept = np.flatnonzero(finite)
    if kept.size:
        fold_group([entries[i] for i in kept], {name: value[kept] for name, value in out.items()})

    for i in np.flatnonzero(~finite):
        acc, x, positions = entries[i]
        reference.add(acc, x, positions)


def fold_group(entries: list[tuple[RunningSums, np.ndarray, np.ndarray]], out: dict[str, np.ndarray]) -> None:
    """Add the device results of pieces of one shape and selection to their accumulators, in
    order: ``entries`` ``(acc, x, pos)`` (``x`` a piece as stored, ``pos`` its positions),
    ``out`` host arrays with a leading axis over the entries. What is left per row here is
    counting histogram bins the device chose and picking the top peaks; it runs once for the
    group, not once per piece: per-piece calls, under the GIL beside the thread that drives the
    device, would be most of the fold."""
    groups = entries[0][0].groups
    n = entries[0][1].shape[0]
    raw, powers = _powers(out, groups, n)
    gram = _gram_of(out, n) if "spectrum" in groups and "product" in out else None
    shared = shared_stack(entries)
    _add_arrays(entries, shared, _array_adds(out, groups), powers, out)
    scalars = _Scalars(out, groups)
    bands = raw[:, 1] if raw is not None and "rope" in groups else None
    _add_each(entries, out, scalars, bands, None if shared is not None else gram)
    if shared is not None and gram is not None:
        arrays, rows = shared
        arrays["gram"][rows] += gram  # after each accumulator's heavy rows, as one by one


def _add_each(
    entries: list[tuple[RunningSums, np.ndarray, np.ndarray]],
    out: dict[str, np.ndarray],
    scalars: _Scalars,
    bands: np.ndarray | None,
    gram: np.ndarray | None,
) -> None:
    """What each accumulator takes alone, in order: its scalars, its RoPE bands' energy
    (``bands`` ``(B, dim)``), its spectrum's Gram matrix (``gram`` ``(B, dim, dim)`` where the
    accumulators do not share one stack)."""
    groups = entries[0][0].groups
    n = entries[0][1].shape[0]
    for b, (acc, x, p) in enumerate(entries):
        scalars.add(acc, b, n, p)
        if bands is not None:
            _add_band(acc, bands[b])
        if "spectrum" in groups:
            _add_gram(acc, x, out, b, None if gram is None else gram[b])


def _powers(
    out: dict[str, np.ndarray], groups: frozenset[str], n: int
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The raw power sums of the group's pieces (None where the device computed none), and what
    the accumulators' power sums take of them: x to x^4 (channels), x (spectrum), or None."""
    raw = _raw_powers(out["shift"], out["central"], n) if "central" in out else None
    if raw is None or not ("channels" in groups or "spectrum" in groups):
        return raw, None
    return raw, raw if "channels" in groups else raw[:, :1]


def _add_band(acc: RunningSums, squares: np.ndarray) -> None:
    """Add a piece's per-channel sums of squares ``(dim,)`` to the accumulator's RoPE bands (a
    band: the two channels RoPE rotates together)."""
    if acc.band is not None and acc.rope is not None:
        first, second = acc.rope.pair_indices()
        acc.band += squares[first] + squares[second]


def _array_adds(out: dict[str, np.ndarray], groups: frozenset[str]) -> dict[str, np.ndarray]:
    """Per array sum, the group's values to add (``(B, ...)``, in order)."""
    adds: dict[str, np.ndarray] = {}
    if "norms" in groups:
        adds.update(
            norm_hist=out["norm_hist"],
            unit_sum=out["unit"],
            position_norm=out["position_norm"].astype(np.float64),
        )
    if "channels" in groups:
        adds["peak_hist"] = out["peak_hist"]
    if "quant" in groups:
        adds["quant_token"] = out["quant_token"].astype(np.float64)
        adds["quant_channel"] = out["quant_channel"].astype(np.float64).sum(axis=-1)
    return adds


def _gram_of(out: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The Gram matrices ``(B, dim, dim)`` of the pieces' light rows: the device's product about
    its shift ``c`` plus the shift's terms ``c s^T + s c^T - n c c^T``."""
    light_rows = n - out["heavy"].astype(np.float64)
    shift = out["center"].astype(np.float64)  # the exact float32 shift the device used
    sums = out["light_sums"].astype(np.float64)
    outer = shift[:, :, None] * sums[:, None, :]
    outer += outer.transpose(0, 2, 1)
    outer -= (light_rows[:, None] * shift)[:, :, None] * shift[:, None, :]
    return outer + out["product"]


def _add_arrays(
    entries: list[tuple[RunningSums, np.ndarray, np.ndarray]],
    shared: tuple[dict[str, np.ndarray], slice | np.ndarray] | None,
    adds: dict[str, np.ndarray],
    powers: np.ndarray | None,
    out: dict[str, np.ndarray],
) -> None:
    """Add the array sums: one call per sum for a stacked group, else accumulator by accumulator."""
    channels = "channels" in entries[0][0].groups
    if shared is not None:
        arrays, rows = shared
        for name, values in adds.items():
            arrays[name][rows] += values
        if powers is not None:
            arrays["power"][rows, : powers.shape[1]] += powers
        if channels:
            arrays["absmax"][rows] = np.maximum(arrays["absmax"][rows], out["absmax"])
        return
    for b, (acc, _, _) in enumerate(entries):
        for name, values in adds.items():
            total = getattr(acc, name)
            total += values[b]
        if powers is not None:
            acc.power[: powers.shape[1]] += powers[b]
        if channels:
            np.maximum(acc.absmax, out["absmax"][b], out=acc.absmax)


class _Scalars:
    """The pieces' scalar results as Python floats (whole-group conversions), added per accumulator."""

    def __init__(self, out: dict[str, np.ndarray], groups: frozenset[str]) -> None:
        self.groups = groups
        self.square_sums = out["sq_sum"].astype(np.float64).tolist()
        if "norms" in groups:
            self.norm_sums = out["norm_sum"].astype(np.float64).tolist()
            self.norm_mins = out["norm_min"].astype(np.float64).tolist()
            self.norm_maxs = out["norm_max"].astype(np.float64).tolist()
            self.norm_firsts = out["norm_first"].astype(np.float64).tolist()
        if "channels" in groups:
            self.top_rows, self.top_peaks = out["top_rows"].tolist(), out["top_peaks"].tolist()

    def add(self, acc: RunningSums, b: int, n: int, positions: np.ndarray) -> None:
        acc.count += n
        acc.norm_sq_sum += self.square_sums[b]
        if "norms" in self.groups:
            acc.norm_sum += self.norm_sums[b]
            acc.norm_min = min(acc.norm_min, self.norm_mins[b])
            acc.norm_max = max(acc.norm_max, self.norm_maxs[b])
            if positions[0] == 0:
                acc.first_norm_sum += self.norm_firsts[b]
                acc.first_count += 1
            acc.position_count += _piece_bin_counts(positions)
        if "channels" in self.groups:
            found = top_found(self.top_rows[b], self.top_peaks[b], positions)
            acc.top = sorted(acc.top + found, reverse=True)[:TOP_K]


def _add_gram(
    acc: RunningSums, x: np.ndarray, out: dict[str, np.ndarray], b: int, light: np.ndarray | None
) -> None:
    """Add piece ``b``'s Gram terms the host computes: all of a small piece (float64, as the CPU
    path does), else its heavy rows (float64), and ``light`` (its light rows' Gram, unless a
    stacked group adds those in one call)."""
    if "product" not in out:
        x64 = float32_rows(x).astype(np.float64)
        acc.gram += x64.T @ x64
        return
    if out["heavy"][b]:
        big = float32_rows(x[out["light"][b] == 0]).astype(np.float64)
        acc.gram += big.T @ big
    if light is not None:
        acc.gram += light
