"""Imported by the fork server of the CPU backend's worker processes (`analysis.engine.processes`): runs each
compiled kernel once on a few rows, so that their machine code is loaded in the server, once (the
C library of `native`), and every
worker forked from it starts with them loaded. It also imports what every worker's first
task would import on its own: the pass's planning module, ml-dtypes (bfloat16 files) and
threadpoolctl (one BLAS thread per worker)."""

from __future__ import annotations

import contextlib

import ml_dtypes  # noqa: F401  (bfloat16 files: kvformat imports it on first use)
import numpy as np

from ..kernels.arrays import GRAM_FLOAT64_ROWS
from ..stats.catalogue import ALL
from ..stats.rope import Rope
from . import plan, processes  # noqa: F401  (a task's own modules)
from .accumulator import HeadAccumulator

with contextlib.suppress(ImportError):  # comes with the analysis extra
    import threadpoolctl  # noqa: F401


def warm() -> None:
    """One accumulator of every group over enough rows to take the float32 Gram path, and its
    row (eigenvalues)."""
    rows = GRAM_FLOAT64_ROWS + 8
    # (not numpy.random: a worker never needs it, and its import lengthens the server's start)
    x = np.sin(np.arange(rows * 8, dtype=np.float32) * np.float32(0.7)).reshape(rows, 8)
    accumulator = HeadAccumulator(8, Rope(10000.0, 8, "half"), ALL)
    accumulator.add(x, np.arange(rows))
    accumulator.row_arrays()


warm()
