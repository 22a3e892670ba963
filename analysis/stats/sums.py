"""The running sums of one (sequence, layer, head, tensor): `RunningSums`, each sum declared once
in `catalogue.SUMS` (shape, merge rule, the groups that read it), allocated and merged from there.
Memory is bounded by ``head_dim^2`` per head, never by the number of tokens, and sums of different
chunks or files merge exactly. Kernels (`analysis.kernels`) add rows into them; `HeadAccumulator`
(`analysis.engine.accumulator`) adds the rows and computes the statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import LayoutMismatchError
from . import finite, statistic
from .catalogue import ALL, SUMS, allocate, merged, stat_groups
from .rope import Rope


class Pending(Protocol):
    """Work a backend left in flight for an accumulator (mlx: device arrays not yet on the host).
    `settle` folds it into the accumulator's sums and clears the accumulator's `pending`."""

    def settle(self) -> None: ...


STACKED = (
    "norm_hist", "peak_hist", "power", "absmax", "gram", "unit_sum", "position_norm",
    "quant_token", "quant_channel",
)  # fmt: skip
"""The array sums `stack` lays out in one array each, across accumulators."""


@dataclass(eq=False)
class Stack:
    """The array sums (`STACKED`) of several accumulators of one dim and selection of groups,
    one array per sum with the accumulators along its first axis: accumulator ``i``'s sum is a
    view of row ``i`` (its `slot`; `layout` is the shared `Stack`)."""

    arrays: dict[str, np.ndarray]


def stack(accumulators: Sequence[RunningSums]) -> Stack | None:
    """Lay out the array sums of ``accumulators`` (one dim, one selection of groups) in one array
    per sum, each accumulator's sums becoming views of its row, their values unchanged: the mlx
    fold then adds a device batch's results into many accumulators with one numpy call per sum
    instead of one per accumulator (`kernels.mlx_fold.fold_group`: each such call of more than a few
    hundred values drops and retakes the interpreter's lock, which the thread driving the device
    holds most of the time). None, and nothing changed, for fewer than two. Whatever rebinds a
    sum afterwards (`HeadAccumulator.merge` does) takes that accumulator out of the layout: the
    fold checks and adds to it alone."""
    if len(accumulators) < 2 or len({(acc.dim, acc.groups) for acc in accumulators}) > 1:
        return None
    shared = Stack({name: np.stack([getattr(acc, name) for acc in accumulators]) for name in STACKED})
    for slot, acc in enumerate(accumulators):
        for name in STACKED:
            setattr(acc, name, shared.arrays[name][slot])
        acc.layout, acc.slot = shared, slot
    return shared


_SUMS = ("rope", "added", *(total.name for total in SUMS if total.shape or total.merge == "top"))
"""What `HeadAccumulator.seal` leaves out of the pickled state: what only `add` and `merge` use
(the sums' arrays; the numbers are small)."""


@dataclass
class RunningSums:
    """Mergeable sums for one (sequence, layer, head, tensor) over vectors of ``dim`` channels,
    for the statistic ``groups`` (see `GROUPS`; all by default). Each sum is declared once in
    `catalogue.SUMS` (shape, merge rule, the groups that read it): allocated and merged from
    there; a kernel adds rows into them."""

    dim: int
    rope: Rope | None = None
    groups: frozenset[str] = ALL
    count: int = 0
    norm_sum: float = 0.0
    norm_sq_sum: float = 0.0
    norm_min: float = float("inf")
    norm_max: float = float("-inf")
    norm_hist: np.ndarray = field(init=False)
    peak_hist: np.ndarray = field(init=False)
    power: np.ndarray = field(init=False)  # (4, dim) sums of x, x^2, x^3, x^4
    absmax: np.ndarray = field(init=False)
    gram: np.ndarray = field(init=False)  # (dim, dim) sum of x x^T; (0, 0) without "spectrum"
    unit_sum: np.ndarray = field(init=False)
    band: np.ndarray | None = field(init=False)
    first_norm_sum: float = 0.0  # ||x|| at position 0, summed over the sequences that hold it
    first_count: int = 0
    position_count: np.ndarray = field(init=False)
    position_norm: np.ndarray = field(init=False)
    top: list[tuple[float, int]] = field(default_factory=list)
    quant_token: np.ndarray = field(init=False)
    quant_channel: np.ndarray = field(init=False)
    backend: str = "cpu"  # the `kernels` name: "cpu" (C, or numpy where not built), "numpy", "mlx"
    nonfinite_rows: int = 0  # rows left out of every sum: they held inf or NaN (`analysis.stats.finite`)
    nonfinite_values: int = 0  # the inf and NaN values in those rows
    added: dict[str, np.ndarray] = field(init=False)  # the sums of added statistics (`statistic`)
    pending: Pending | None = field(default=None, init=False, repr=False, compare=False)
    computed_row: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    layout: Stack | None = field(default=None, init=False, repr=False, compare=False)  # see `stack`
    slot: int = field(default=0, init=False, repr=False, compare=False)  # this one's row in `layout`
    _sealed: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.groups = stat_groups(self.groups)
        band = self.rope.dims // 2 if self.rope is not None else None
        for total in SUMS:
            if total.shape:
                setattr(self, total.name, allocate(total, self.dim, band, self.groups))
        self.added = statistic.allocated(statistic.active(self.groups), self.dim)

    def add_added(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """Add ``rows`` ``(n, dim)`` at ``positions`` into the sums of the added statistics of
        this accumulator's groups (`statistic`; nothing where none is added): what every backend
        calls beside its own kernel, with the rows it was given."""
        if self.added:
            statistic.add(statistic.active(self.groups), self.added, rows, positions)

    def sums_by_name(self) -> dict[str, Any]:
        """Every sum by name (the catalogue's, the added statistics', and ``dim``): what an added
        statistic's value is computed from."""
        return {total.name: getattr(self, total.name) for total in SUMS} | self.added | {"dim": self.dim}

    def prepare_add(self) -> None:
        """What a backend calls before it adds rows: refuses a sealed accumulator and forgets the
        computed row."""
        self._check_open()
        self.computed_row = None

    def drop_nonfinite(self, rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``rows`` ``(n, dim)`` and ``positions`` without the rows that hold inf or NaN, counted
        in `nonfinite_rows` / `nonfinite_values` (the same arrays when there are none)."""
        kept, kept_positions, bad_rows, bad_values = finite.split(rows, positions)
        self.nonfinite_rows += bad_rows
        self.nonfinite_values += bad_values
        return kept, kept_positions

    def settle(self) -> None:
        """Fold in work a backend left in flight (`pending`; the mlx backend's device work)."""
        if self.pending is not None:
            self.pending.settle()

    def __getstate__(self) -> dict[str, Any]:
        self.settle()  # device arrays do not cross processes; their sums do
        state = dict(self.__dict__)
        state["layout"] = None  # its own sums cross (as copies of its rows); the others' stay
        if self._sealed:  # the row alone crosses
            state.update(dict.fromkeys(_SUMS))
        return state

    def _check_open(self) -> None:
        if self._sealed:
            # internal: the pass adds no rows after computing a head's statistics
            raise RuntimeError("this accumulator is sealed (its row computed, its sums dropped)")

    def merge(self, other: RunningSums) -> None:
        """Add another accumulator of the same (layer, head, tensor) into this one (another chunk,
        sequence or file); raises ValueError when the channel counts or the groups differ."""
        self._check_open()
        other._check_open()
        self.settle()
        other.settle()
        if other.dim != self.dim:
            raise LayoutMismatchError(
                f"cannot merge {other.dim}-channel statistics into {self.dim}-channel ones"
            )
        if other.groups != self.groups:
            raise LayoutMismatchError(
                f"cannot merge statistics of groups {sorted(other.groups)} into {sorted(self.groups)}"
            )
        self.computed_row = None
        for total in SUMS:
            setattr(self, total.name, merged(total, getattr(self, total.name), getattr(other, total.name)))
        if self.added.keys() != other.added.keys():
            raise LayoutMismatchError(
                "cannot merge statistics computed with different added statistics "
                f"({sorted(other.added)} into {sorted(self.added)})"
            )
        statistic.merge(statistic.active(self.groups), self.added, other.added)
