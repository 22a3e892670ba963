"""`HeadAccumulator`: the running sums of one (sequence, layer, head, tensor) (`stats.sums.RunningSums`)
with the two things a user asks of them: add rows (with the accumulator's kernel,
`kernels.of(backend)`) and compute the statistics (`rows.statistics`). An accumulator holds sums
only, so memory is bounded by ``head_dim^2`` per head and accumulators of different chunks or files
merge exactly (`RunningSums.merge`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import kernels
from ..stats.sums import STACKED, Pending, RunningSums, Stack, stack
from .rows import statistics as row_statistics

if TYPE_CHECKING:
    from kvformat import PayloadCheck

__all__ = ["STACKED", "HeadAccumulator", "Pending", "Stack", "stack"]


class HeadAccumulator(RunningSums):
    """`RunningSums` for ``dim`` channels and the statistic ``groups`` (see `GROUPS`; all by
    default), with `add` and `row`."""

    def add(self, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None) -> None:
        """Add ``rows`` ``(n_tokens, dim)`` at absolute ``positions`` ``(n_tokens,)`` with this
        accumulator's backend (`kernels.of(backend)`; a pass picks its backend once and calls it
        directly). ``check``: the CRC ``rows`` must have (`kvformat.ChecksumError` when they do not;
        the accumulator is then to be dropped). Rows holding inf or NaN are left out and counted."""
        kernels.of(self.backend).add(self, rows, positions, check)

    def seal(self) -> None:
        """Compute the row and seal the accumulator: pickled, it carries the row without its sums
        (at 128 channels ~6 KB instead of ~180 KB, most of it the Gram matrix and the histograms:
        what a pass that wants the rows alone sends from its worker processes), and it refuses
        `add` and `merge`."""
        self.row_arrays()
        self._sealed = True

    def row(self) -> dict[str, Any]:
        """The statistics of the accumulator's groups, ``n_tokens`` first (see analysis/README.md
        for each formula); columns of groups not computed are absent; vector columns are lists.
        Computed once until the next `add` or `merge` (a pass computes it on its worker
        threads)."""
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in self.row_arrays().items()}

    def row_arrays(self) -> dict[str, Any]:
        """`row` with the vector columns as float64 numpy arrays ``(dim,)`` (``eigenvalues``,
        ``channel_*``, ``norm_by_position``, ``rope_band_energy``): what the Arrow tables are
        built from, without a Python float per value."""
        if self.computed_row is None:
            self.computed_row = self._statistics()
        return dict(self.computed_row)

    def _statistics(self) -> dict[str, Any]:
        self.settle()
        return row_statistics([self])[0]
